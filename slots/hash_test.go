package slots

import (
	"slices"
	"testing"
)

func TestBlockHashes(t *testing.T) {
	t.Parallel()
	a := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	ha := BlockHashes(a, 4)
	if len(ha) != 2 {
		t.Fatalf("9 tokens in blocks of 4: %d hashes, want 2 (the partial block has none)", len(ha))
	}
	if ha[0] == ha[1] {
		t.Fatalf("two blocks share a hash: %v", ha)
	}
	if again := BlockHashes(slices.Clone(a), 4); !slices.Equal(again, ha) {
		t.Fatalf("not deterministic: %v then %v", ha, again)
	}
	// The same first block: the same first hash. A different first block:
	// every later hash differs too, though the later tokens are the same.
	b := []uint32{1, 2, 3, 4, 50, 60, 70, 80}
	if hb := BlockHashes(b, 4); hb[0] != ha[0] || hb[1] == ha[1] {
		t.Fatalf("shared prefix: %v vs %v", hb, ha)
	}
	c := []uint32{9, 2, 3, 4, 5, 6, 7, 8}
	if hc := BlockHashes(c, 4); hc[0] == ha[0] || hc[1] == ha[1] {
		t.Fatalf("chained: a changed first block must change the second hash: %v vs %v", hc, ha)
	}
	if got := BlockHashes(a, 0); got != nil {
		t.Fatalf("block size 0: %v", got)
	}
	if got := BlockHashes(a[:3], 4); len(got) != 0 {
		t.Fatalf("shorter than a block: %v", got)
	}
}

func TestTextTokens(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		text string
		want uint64
	}{{"", 0}, {"abc", 1}, {"abcd", 1}, {"abcde", 2}, {"héllo wörld", 3}, {"日本語のテキスト", 2}} {
		if got := TextTokens(tt.text); got != tt.want {
			t.Errorf("TextTokens(%q) = %d, want %d", tt.text, got, tt.want)
		}
	}
}
