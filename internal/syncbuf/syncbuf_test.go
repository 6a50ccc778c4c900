package syncbuf

import (
	"fmt"
	"slices"
	"sync"
	"testing"
)

func TestBuffer(t *testing.T) {
	t.Parallel()
	var b Buffer
	if got := b.Lines(); got != nil {
		t.Errorf("Lines of an empty buffer = %q", got)
	}
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for range 100 {
				fmt.Fprintf(&b, "w%d\n", i)
				_ = b.String()
			}
		})
	}
	wg.Wait()
	if n := len(b.Lines()); n != 400 {
		t.Errorf("%d lines, want 400", n)
	}

	var c Buffer
	c.Write([]byte("one\ntwo\nthr"))
	if got := c.Lines(); !slices.Equal(got, []string{"one", "two"}) {
		t.Errorf("Lines = %q, want the complete ones", got)
	}
	if got := c.Tail(5); got != "…o\nthr" {
		t.Errorf("Tail(5) = %q", got)
	}
	if got := c.Tail(100); got != "one\ntwo\nthr" {
		t.Errorf("Tail(100) = %q", got)
	}
}
