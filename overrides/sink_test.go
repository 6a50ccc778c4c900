package overrides

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvwatch"
)

// sinkTestEntry is a KV entry as a watch delivers it.
type sinkTestEntry struct {
	key   string
	value string
	rev   uint64
	op    jetstream.KeyValueOp
}

func (e sinkTestEntry) Bucket() string                  { return "test" }
func (e sinkTestEntry) Key() string                     { return e.key }
func (e sinkTestEntry) Value() []byte                   { return []byte(e.value) }
func (e sinkTestEntry) Revision() uint64                { return e.rev }
func (e sinkTestEntry) Created() time.Time              { return time.Time{} }
func (e sinkTestEntry) Delta() uint64                   { return 0 }
func (e sinkTestEntry) Operation() jetstream.KeyValueOp { return e.op }

// TestThreshSink checks the OnChange calls of the thresholds bucket's sink,
// through full syncs (watchReset … watchPublish) and live entries.
func TestThreshSink(t *testing.T) {
	t.Parallel()
	put := func(key, value string) sinkTestEntry {
		return sinkTestEntry{key: key, value: value, op: jetstream.KeyValuePut}
	}
	del := func(key string) sinkTestEntry { return sinkTestEntry{key: key, op: jetstream.KeyValueDelete} }
	purge := func(key string) sinkTestEntry { return sinkTestEntry{key: key, op: jetstream.KeyValuePurge} }
	// A step is an entry, or "reset" or "publish".
	type step struct {
		call string
		e    sinkTestEntry
	}
	apply := func(e sinkTestEntry) step { return step{e: e} }
	reset, publish := step{call: "reset"}, step{call: "publish"}
	tests := []struct {
		name  string
		steps []step
		want  []string
		bad   int // entries rejected
	}{
		{
			name:  "first sync skips deletes of unknown models",
			steps: []step{reset, apply(put("a", "{}")), apply(del("b")), publish},
			want:  []string{"put a"},
		},
		{
			name: "live deletes pass",
			steps: []step{reset, apply(put("a", "{}")), publish,
				apply(del("a")), apply(purge("c")), publish},
			want: []string{"put a", "delete a", "delete c"},
		},
		{
			name: "full resync reports the missing as deleted",
			steps: []step{reset, apply(put("a", "{}")), apply(put("b", "{}")), apply(put("c", "{}")), publish,
				reset, apply(put("b", "{}")), apply(del("c")), apply(put("d", "{}")), publish},
			want: []string{"put a", "put b", "put c", "put b", "delete c", "put d", "delete a"},
		},
		{
			name: "an invalid value keeps the override in force, even through a resync",
			steps: []step{reset, apply(put("a", "{}")), publish,
				reset, apply(put("a", `{"active_decode_blocks_threshold":2}`)), publish},
			want: []string{"put a"},
			bad:  1,
		},
		{
			name:  "keys that are not model keys are rejected",
			steps: []step{reset, apply(put("x=zz", "{}")), apply(put("a", "not json")), publish},
			bad:   2,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			m, err := newWatcherMetrics(prometheus.NewRegistry(), "threshold", events.ThresholdsBucket)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			s := &changeSink[events.Thresholds]{metrics: m, known: make(map[string]struct{}),
				sinkFuncs: thresholdSink(func(model string, _ events.Thresholds, deleted bool) {
					op := "put"
					if deleted {
						op = "delete"
					}
					got = append(got, op+" "+model)
				})}
			bad := 0
			for i, st := range tt.steps {
				switch st.call {
				case "reset":
					s.Reset()
				case "publish":
					s.Publish()
				default:
					st.e.rev = uint64(i + 1)
					if err := s.Apply(st.e, time.Time{}); err != nil {
						if _, ok := errors.AsType[*kvwatch.RecordError](err); !ok {
							t.Errorf("entry %d: error %v is no kvwatch.RecordError", i, err)
						}
						bad++
					}
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("OnChange calls = %q, want %q", got, tt.want)
			}
			if bad != tt.bad {
				t.Errorf("rejected %d entries, want %d", bad, tt.bad)
			}
			if n := s.Publish(); n != len(s.known) {
				t.Errorf("Publish = %d, want %d", n, len(s.known))
			}
		})
	}
}
