package slots

import (
	"encoding/binary"
	"hash/fnv"
	"math/rand/v2"
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

// referenceBlockHashes is the contract's hash spelled with hash/fnv: 64-bit
// FNV-1a over the previous hash and the block's tokens, little-endian.
func referenceBlockHashes(tokens []uint32, blockSize uint32) []uint64 {
	var out []uint64
	var prev uint64
	for i := 0; i+int(blockSize) <= len(tokens); i += int(blockSize) {
		buf := binary.LittleEndian.AppendUint64(nil, prev)
		for _, tok := range tokens[i : i+int(blockSize)] {
			buf = binary.LittleEndian.AppendUint32(buf, tok)
		}
		h := fnv.New64a()
		_, _ = h.Write(buf)
		prev = h.Sum64()
		out = append(out, prev)
	}
	return out
}

// TestBlockHashesFNV: the hashes are FNV-1a as the contract spells it, so
// every router of a fleet (of any release) hashes alike; appending to a
// slice with room allocates nothing.
func TestBlockHashesFNV(t *testing.T) { // not parallel: it counts allocations
	rng := rand.New(rand.NewPCG(1, 2))
	for _, bs := range []uint32{1, 4, 16, 64} {
		tokens := make([]uint32, 300)
		for i := range tokens {
			tokens[i] = rng.Uint32()
		}
		want := referenceBlockHashes(tokens, bs)
		if got := BlockHashes(tokens, bs); !slices.Equal(got, want) {
			t.Fatalf("block size %d: %v, want %v", bs, got, want)
		}
		dst := []uint64{42}
		if got := AppendBlockHashes(dst, tokens, bs); got[0] != 42 || !slices.Equal(got[1:], want) {
			t.Fatalf("block size %d: appended %v, want 42 then %v", bs, got, want)
		}
		buf := make([]uint64, 0, len(want))
		if allocs := testing.AllocsPerRun(10, func() { buf = AppendBlockHashes(buf[:0], tokens, bs) }); allocs != 0 {
			t.Errorf("block size %d: %v allocations appending to a slice with room", bs, allocs)
		}
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
