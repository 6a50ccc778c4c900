package slots

import (
	"encoding/binary"
	"hash/fnv"
	"unicode/utf8"
)

// BlockHashes returns the chained hashes of a prompt's complete blocks of
// blockSize tokens (contract §11): hash i covers the whole prefix up to the
// end of block i, through hash i-1, so two prompts share a block hash only
// when they share the prefix up to it, as a prefix cache shares KV blocks.
// A trailing partial block has no hash. The hash is 64-bit FNV-1a over the
// previous hash and the block's tokens, little-endian: stable across
// processes and releases, so every router of a fleet hashes alike.
func BlockHashes(tokens []uint32, blockSize uint32) []uint64 {
	if blockSize == 0 {
		return nil
	}
	n := len(tokens) / int(blockSize)
	out := make([]uint64, 0, n)
	h := fnv.New64a()
	buf := make([]byte, 8+4*int(blockSize))
	var prev uint64
	for i := range n {
		binary.LittleEndian.PutUint64(buf, prev)
		for j, tok := range tokens[i*int(blockSize) : (i+1)*int(blockSize)] {
			binary.LittleEndian.PutUint32(buf[8+4*j:], tok)
		}
		h.Reset()
		_, _ = h.Write(buf)
		prev = h.Sum64()
		out = append(out, prev)
	}
	return out
}

// CharsPerToken is the estimate of characters per token for a prompt that
// carries text, not token ids (contract §11).
const CharsPerToken = 4

// TextTokens estimates the tokens of a text prompt: its characters (not
// bytes) divided by CharsPerToken, rounded up.
func TextTokens(text string) uint64 {
	n := uint64(utf8.RuneCountInString(text))
	return (n + CharsPerToken - 1) / CharsPerToken
}
