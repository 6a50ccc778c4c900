package events

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

const hexDigits = "0123456789ABCDEF"

// keepByte reports whether b stays as it is in a model_key.
func keepByte(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' ||
		b == '_' || b == '/' || b == '-'
}

// ValidateModel checks a model name against the contract: 1 to MaxModelLen
// bytes of valid UTF-8.
func ValidateModel(model string) error {
	switch {
	case model == "":
		return fmt.Errorf("events: model name is empty: %w", ErrInvalidModel)
	case len(model) > MaxModelLen:
		return fmt.Errorf("events: model name is %d bytes, more than %d: %w", len(model), MaxModelLen, ErrInvalidModel)
	case !utf8.ValidString(model):
		return fmt.Errorf("events: model name is not valid UTF-8: %w", ErrInvalidModel)
	}
	return nil
}

// ModelKey encodes a model name for use as one NATS subject token and as a
// KV key: bytes in [A-Za-z0-9_/-] stay, every other byte becomes '=' and two
// upper-case hex digits. It does not validate the name.
func ModelKey(model string) string {
	n := 0
	for i := 0; i < len(model); i++ {
		if !keepByte(model[i]) {
			n++
		}
	}
	if n == 0 {
		return model
	}
	var b strings.Builder
	b.Grow(len(model) + 2*n)
	for i := 0; i < len(model); i++ {
		c := model[i]
		if keepByte(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('=')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&0xF])
	}
	return b.String()
}

// ParseModelKey decodes a model_key back to the model name. Only the
// canonical form is accepted: upper-case hex, and only bytes outside the kept
// set escaped; the decoded name must be a valid model name.
func ParseModelKey(key string) (string, error) {
	var b strings.Builder
	b.Grow(len(key))
	for i := 0; i < len(key); i++ {
		c := key[i]
		if keepByte(c) {
			b.WriteByte(c)
			continue
		}
		if c != '=' || i+2 >= len(key) {
			return "", fmt.Errorf("events: model key %q: byte %d is not allowed: %w", key, i, ErrInvalidModel)
		}
		hi, lo := unhex(key[i+1]), unhex(key[i+2])
		if hi < 0 || lo < 0 {
			return "", fmt.Errorf("events: model key %q: bad escape at byte %d: %w", key, i, ErrInvalidModel)
		}
		v := byte(hi<<4 | lo)
		if keepByte(v) {
			return "", fmt.Errorf("events: model key %q: byte %d escapes %q needlessly: %w", key, i, v, ErrInvalidModel)
		}
		b.WriteByte(v)
		i += 2
	}
	model := b.String()
	if err := ValidateModel(model); err != nil {
		return "", err
	}
	return model, nil
}

// unhex decodes one upper-case hex digit, or returns -1.
func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}
