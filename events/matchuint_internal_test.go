package events

import (
	"math"
	"strconv"
	"testing"
)

func TestMatchUint(t *testing.T) {
	t.Parallel()
	for _, v := range []uint64{0, 1, 9, 10, 99, 12345, math.MaxUint32, math.MaxUint64 - 1, math.MaxUint64} {
		tok := strconv.FormatUint(v, 10)
		if !matchUint(tok, v) {
			t.Errorf("matchUint(%q, %d) = false", tok, v)
		}
		for _, bad := range []string{"0" + tok, tok + "0", "+" + tok, tok + " ", "", "-" + tok, tok + "a"} {
			if matchUint(bad, v) {
				t.Errorf("matchUint(%q, %d) = true", bad, v)
			}
		}
	}
	if matchUint("18446744073709551616", 0) || matchUint("99999999999999999999", math.MaxUint64) {
		t.Error("an overflowing token matched")
	}
}
