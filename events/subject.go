package events

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Kind tells the subjects apart: an engine's reports and goodbyes, and a
// router's estimates and goodbyes (contract §1, §11).
type Kind uint8

// Subject kinds.
const (
	// KindLoad: <prefix>.load.<model_key>.<worker_id>.<dp_rank>.
	KindLoad Kind = iota + 1
	// KindBye: <prefix>.bye.<model_key>.<worker_id>.
	KindBye
	// KindEst: <prefix>.est.<model_key>.<worker_id>.<dp_rank>, a router's
	// estimate.
	KindEst
	// KindEstBye: <prefix>.est.<model_key>.<worker_id>.bye, a router's
	// goodbye for its estimates of one worker. It keeps the shape of an est
	// subject, so the partition mapping and the permissions on est.> cover
	// it; "bye" is never a rank.
	KindEstBye
	// KindLat: <prefix>.lat.<model_key>.<worker_id>, an engine's latency
	// window (contract §18).
	KindLat
	// KindLatr: <prefix>.latr.<model_key>.<worker_id>, a router's latency
	// window.
	KindLatr
	// KindRq: <prefix>.rq.<model_key>, a router's queue of one model
	// (contract §22). Its subject has no worker token.
	KindRq
)

// String names the kind as its subject token does ("est.bye" for
// KindEstBye).
func (k Kind) String() string {
	switch k {
	case KindLoad:
		return "load"
	case KindBye:
		return "bye"
	case KindEst:
		return "est"
	case KindEstBye:
		return "est.bye"
	case KindLat:
		return "lat"
	case KindLatr:
		return "latr"
	case KindRq:
		return "rq"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// reports reports whether a subject of kind k carries a LoadReport.
func (k Kind) reports() bool { return k == KindLoad || k == KindEst }

// estimates reports whether a subject of kind k carries a router's message.
func (k Kind) estimates() bool { return k == KindEst || k == KindEstBye }

// Subject is a parsed load or goodbye subject. Tokens are kept as they
// arrived so that they can be compared to the payload exactly.
type Subject struct {
	Kind Kind
	// Mapped is true for a subject a NATS server mapped under
	// <prefix>.part.<p> (contract §10); Partition is then p.
	Mapped    bool
	Partition int
	ModelKey  string
	WorkerID  string // decimal worker id token; empty for KindRq
	DPRank    string // decimal rank token; empty for KindBye, KindEstBye, KindLat, KindLatr and KindRq
}

// LoadSubject is the subject a rank's report is published on:
// <prefix>.load.<model_key>.<worker_id>.<dp_rank>.
func LoadSubject(prefix, model string, workerID uint64, rank uint32) string {
	return prefix + ".load." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10) + "." +
		strconv.FormatUint(uint64(rank), 10)
}

// EstSubject is the subject a router's estimate for a rank is published
// on: <prefix>.est.<model_key>.<worker_id>.<dp_rank>.
func EstSubject(prefix, model string, workerID uint64, rank uint32) string {
	return prefix + ".est." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10) + "." +
		strconv.FormatUint(uint64(rank), 10)
}

// EstByeSubject is the subject a router's goodbye for its estimates of one
// worker is published on: <prefix>.est.<model_key>.<worker_id>.bye.
func EstByeSubject(prefix, model string, workerID uint64) string {
	return prefix + ".est." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10) + ".bye"
}

// ByeSubject is the subject a goodbye is published on:
// <prefix>.bye.<model_key>.<worker_id>.
func ByeSubject(prefix, model string, workerID uint64) string {
	return prefix + ".bye." + ModelKey(model) + "." + strconv.FormatUint(workerID, 10)
}

// RqSubject is the subject a router's queue of one model is published on
// (contract §22): <prefix>.rq.<model_key>.
func RqSubject(prefix, model string) string {
	return prefix + ".rq." + ModelKey(model)
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

// ParseSubject splits a subject under prefix into its kind and tokens,
// accepting the plain form and the form a partition mapping gives
// (<prefix>.part.<p>.load..., contract §10). It checks the shape only;
// Report.Match and Goodbye.Match compare the tokens with a payload.
func ParseSubject(prefix, subject string) (Subject, error) {
	rest, ok := strings.CutPrefix(subject, prefix+".")
	if !ok {
		return Subject{}, fmt.Errorf("events: subject %q is not under %q: %w", subject, prefix, ErrInvalidSubject)
	}
	kind, rest, _ := strings.Cut(rest, ".")
	var s Subject
	if kind == "part" {
		var tok string
		tok, rest, _ = strings.Cut(rest, ".")
		p, err := strconv.ParseUint(tok, 10, 31)
		if err != nil || !matchUint(tok, p) {
			return Subject{}, fmt.Errorf("events: subject %q: bad partition %q: %w", subject, tok, ErrInvalidSubject)
		}
		s.Mapped, s.Partition = true, int(p)
		kind, rest, _ = strings.Cut(rest, ".")
	}
	var want int
	switch kind {
	case "load":
		s.Kind, want = KindLoad, 3
	case "bye":
		s.Kind, want = KindBye, 2
	case "est":
		s.Kind, want = KindEst, 3
	case "lat":
		s.Kind, want = KindLat, 2
	case "latr":
		s.Kind, want = KindLatr, 2
	case "rq":
		s.Kind, want = KindRq, 1
	default:
		return Subject{}, fmt.Errorf("events: subject %q: unknown kind %q: %w", subject, kind, ErrInvalidSubject)
	}
	if strings.Count(rest, ".") != want-1 {
		return Subject{}, fmt.Errorf("events: subject %q: want %d tokens after %q: %w", subject, want, kind, ErrInvalidSubject)
	}
	s.ModelKey, rest, _ = strings.Cut(rest, ".")
	switch want {
	case 1:
		if s.ModelKey == "" {
			return Subject{}, fmt.Errorf("events: subject %q has an empty token: %w", subject, ErrInvalidSubject)
		}
		return s, nil
	case 2:
		s.WorkerID = rest
	default:
		s.WorkerID, s.DPRank, _ = strings.Cut(rest, ".")
	}
	if s.Kind == KindEst && s.DPRank == "bye" {
		s.Kind, s.DPRank = KindEstBye, ""
	} else if want == 3 && s.DPRank == "" {
		return Subject{}, fmt.Errorf("events: subject %q has an empty token: %w", subject, ErrInvalidSubject)
	}
	if s.ModelKey == "" || s.WorkerID == "" {
		return Subject{}, fmt.Errorf("events: subject %q has an empty token: %w", subject, ErrInvalidSubject)
	}
	return s, nil
}

// matchUint reports whether tok is the canonical decimal form of v: digits
// only, no leading zero but in "0" itself.
func matchUint(tok string, v uint64) bool {
	if tok == "" || tok[0] == '0' && len(tok) > 1 {
		return false
	}
	var n uint64
	for i := 0; i < len(tok); i++ {
		d := uint64(tok[i] - '0')
		if d > 9 || n > (math.MaxUint64-d)/10 {
			return false
		}
		n = n*10 + d
	}
	return n == v
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
