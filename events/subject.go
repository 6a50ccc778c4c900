package events

import (
	"fmt"
	"strconv"
	"strings"
)

// Kind tells a load subject from a goodbye subject.
type Kind uint8

// Subject kinds.
const (
	KindLoad Kind = iota + 1
	KindBye
)

// Subject is a parsed load or goodbye subject. Tokens are kept as they
// arrived so that they can be compared to the payload exactly.
type Subject struct {
	Kind     Kind
	ModelKey string
	WorkerID string // decimal worker id token
	DPRank   string // decimal rank token; empty for KindBye
}

// LoadSubject is the subject a rank's report is published on:
// <prefix>.load.<model_key>.<worker_id>.<dp_rank>.
func LoadSubject(prefix, model string, workerID uint64, rank uint32) string {
	return prefix + ".load." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10) + "." +
		strconv.FormatUint(uint64(rank), 10)
}

// ByeSubject is the subject a goodbye is published on:
// <prefix>.bye.<model_key>.<worker_id>.
func ByeSubject(prefix, model string, workerID uint64) string {
	return prefix + ".bye." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10)
}

// Wildcard subscribes to every subject under prefix: reports and goodbyes
// on one subscription keep the order in which one publisher sent them.
func Wildcard(prefix string) string { return prefix + ".>" }

// ValidatePrefix checks a subject prefix: one or more non-empty tokens
// without wildcards or white space.
func ValidatePrefix(prefix string) error {
	if prefix == "" {
		return fmt.Errorf("events: subject prefix is empty: %w", ErrInvalidSubject)
	}
	for _, tok := range strings.Split(prefix, ".") {
		if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
			return fmt.Errorf("events: subject prefix %q: bad token %q: %w", prefix, tok, ErrInvalidSubject)
		}
	}
	return nil
}

// ParseSubject splits a subject under prefix into its kind and tokens. It
// checks the shape only; Report.Match and Goodbye.Match compare the tokens
// with a payload.
func ParseSubject(prefix, subject string) (Subject, error) {
	rest, ok := strings.CutPrefix(subject, prefix+".")
	if !ok {
		return Subject{}, fmt.Errorf("events: subject %q is not under %q: %w", subject, prefix, ErrInvalidSubject)
	}
	kind, rest, _ := strings.Cut(rest, ".")
	var s Subject
	var want int
	switch kind {
	case "load":
		s.Kind, want = KindLoad, 3
	case "bye":
		s.Kind, want = KindBye, 2
	default:
		return Subject{}, fmt.Errorf("events: subject %q: unknown kind %q: %w", subject, kind, ErrInvalidSubject)
	}
	if strings.Count(rest, ".") != want-1 {
		return Subject{}, fmt.Errorf("events: subject %q: want %d tokens after %q: %w", subject, want, kind, ErrInvalidSubject)
	}
	s.ModelKey, rest, _ = strings.Cut(rest, ".")
	if s.Kind == KindLoad {
		s.WorkerID, s.DPRank, _ = strings.Cut(rest, ".")
	} else {
		s.WorkerID = rest
	}
	if s.ModelKey == "" || s.WorkerID == "" || s.Kind == KindLoad && s.DPRank == "" {
		return Subject{}, fmt.Errorf("events: subject %q has an empty token: %w", subject, ErrInvalidSubject)
	}
	return s, nil
}

// matchUint reports whether tok is the canonical decimal form of v.
func matchUint(tok string, v uint64) bool {
	var buf [20]byte
	return string(strconv.AppendUint(buf[:0], v, 10)) == tok
}

// matchModel reports whether key is exactly ModelKey(model), without
// allocating.
func matchModel(key, model string) bool {
	j := 0
	for i := 0; i < len(model); i++ {
		c := model[i]
		if keepByte(c) {
			if j >= len(key) || key[j] != c {
				return false
			}
			j++
			continue
		}
		if j+2 >= len(key) || key[j] != '=' || key[j+1] != hexDigits[c>>4] || key[j+2] != hexDigits[c&0xF] {
			return false
		}
		j += 3
	}
	return j == len(key)
}
