package slots

import (
	"slices"
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
	return AppendBlockHashes(make([]uint64, 0, len(tokens)/int(blockSize)), tokens, blockSize)
}

// AppendBlockHashes appends the BlockHashes of tokens to dst and returns
// the extended slice; it allocates nothing beyond dst's growth (the
// router's request path calls it).
func AppendBlockHashes(dst []uint64, tokens []uint32, blockSize uint32) []uint64 {
	if blockSize == 0 {
		return dst
	}
	var prev uint64
	for block := range slices.Chunk(tokens, int(blockSize)) {
		if len(block) < int(blockSize) {
			break // a trailing partial block has no hash
		}
		h := uint64(fnvOffset64)
		for i := range 8 {
			h = (h ^ uint64(byte(prev>>(8*i)))) * fnvPrime64
		}
		for _, tok := range block {
			for i := range 4 {
				h = (h ^ uint64(byte(tok>>(8*i)))) * fnvPrime64
			}
		}
		prev = h
		dst = append(dst, prev)
	}
	return dst
}

// The parameters of 64-bit FNV-1a (as hash/fnv's New64a).
const (
	fnvOffset64 = 14695981039346656037
	fnvPrime64  = 1099511628211
)

// CharsPerToken is the estimate of characters per token for a prompt that
// carries text, not token ids (contract §11).
const CharsPerToken = 4

// TextTokens estimates the tokens of a text prompt: its characters (not
// bytes) divided by CharsPerToken, rounded up.
func TextTokens(text string) uint64 {
	n := uint64(utf8.RuneCountInString(text))
	return (n + CharsPerToken - 1) / CharsPerToken
}
