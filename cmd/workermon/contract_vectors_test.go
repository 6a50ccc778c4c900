package main_test

import (
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/internal/natstest"
)

// The shared test vectors (DESIGN §2–3), made by another language's msgpack
// library and by hand, sent to a running monitor.
type vectors struct {
	Reports []struct {
		Name    string         `json:"name"`
		Subject string         `json:"subject"`
		Hex     string         `json:"hex"`
		Valid   bool           `json:"valid"`
		Expect  map[string]any `json:"expect"`
	} `json:"reports"`
	ModelKeys []struct {
		Model string `json:"model"`
		Key   string `json:"key"`
	} `json:"model_keys"`
	// RouterQueues are the routers' queue reports of contract §22.
	RouterQueues []struct {
		Name    string `json:"name"`
		Subject string `json:"subject"`
		Hex     string `json:"hex"`
		Valid   bool   `json:"valid"`
	} `json:"router_queues"`
}

func loadVectors(t *testing.T) vectors {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "testdata", "contract-vectors.json"))
	if err != nil {
		t.Skipf("no vectors: %v", err)
	}
	var v vectors
	d := json.NewDecoder(strings.NewReader(string(b)))
	d.UseNumber()
	if err := d.Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestContractVectorsModelKeys(t *testing.T) {
	for _, mk := range loadVectors(t).ModelKeys {
		if got := modelKey(mk.Model); got != mk.Key {
			t.Errorf("modelKey(%q) = %q, want %q (test helper)", mk.Model, got, mk.Key)
		}
	}
}

// TestContractVectorsValid: each valid vector, on its own monitor (they share
// boot and seq), is accepted; the kv vectors make worker 7 busy with "kv".
func TestContractVectorsValid(t *testing.T) {
	t.Parallel()
	for _, v := range loadVectors(t).Reports {
		if !v.Valid {
			continue
		}
		t.Run(v.Name, func(t *testing.T) {
			t.Parallel()
			m, c, kv := startMonitorKV(t, monOpt{flags: long("--active-decode-blocks-threshold", "0.5")})
			data, err := hex.DecodeString(v.Hex)
			if err != nil {
				t.Fatal(err)
			}
			tok := strings.Split(v.Subject, ".")
			wid := tok[len(tok)-2]
			model := v.Expect["model"]
			if model == nil {
				model = "Qwen/Qwen3-0.6B"
			}
			if tok[1] == "est" {
				// A router's estimate adds load to a worker an engine
				// reports; alone it lists nothing (estimates are not
				// liveness): the engine reports first.
				id, err := strconv.ParseUint(wid, 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				newPub(t, c, model.(string), id).withDP(2, 4).report(2, f("active_decode_blocks", 0, "kv_total_blocks", 100))
			}
			publish(t, c.nc, v.Subject, data)
			r := waitRecord(t, kv, model.(string), "worker "+wid+" listed", func(r record) bool {
				for _, l := range []string{"busy", "free", "stale"} {
					for _, id := range r.ids(l) {
						if formatU(id) == wid {
							return true
						}
					}
				}
				return false
			})
			if src, ok := v.Expect["source"].(string); ok {
				// The source's state is at the monitor.
				natstest.WaitFor(t, 5*time.Second, "source "+src+" in GET /loads", func() bool {
					resp, err := http.Get(m.base + "/loads?model=" + url.QueryEscape(model.(string)))
					if err != nil {
						return false
					}
					defer resp.Body.Close()
					b, _ := io.ReadAll(resp.Body)
					return strings.Contains(string(b), `"`+src+`"`)
				})
			}
			if adb, ok := v.Expect["active_decode_blocks"].(json.Number); ok && adb.String() == "80" {
				if r.reasons()[wid] != "kv" {
					t.Errorf("80/100 blocks under threshold 0.5: want busy with reason kv: %v", r)
				}
			}
		})
	}
}

// TestContractVectorsInvalid: every invalid vector is rejected and counted.
func TestContractVectorsInvalid(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{flags: long("--active-decode-blocks-threshold", "0.5")})
	c := m.client(t)
	before := m.rejected(t, "")
	n := 0
	for _, v := range loadVectors(t).Reports {
		if v.Valid {
			continue
		}
		data, err := hex.DecodeString(v.Hex)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(v.Subject, "..") {
			// an empty subject token: not a valid subject, the server may refuse it
			oc := connect(t, m.natsURL)
			_ = oc.nc.Publish(v.Subject, data)
			_ = oc.nc.Flush()
			continue
		}
		publish(t, c.nc, v.Subject, data)
		n++
	}
	r := barrier(t, c, "Qwen/Qwen3-0.6B")
	for _, id := range []uint64{7, 8} {
		if w := r.where(id); w != "" {
			t.Errorf("worker %d from an invalid vector listed in %s: %v", id, w, r)
		}
	}
	m.waitRejected(t, "", before+float64(n))
	if !m.alive() {
		t.Fatal("monitor died")
	}
}

func formatU(u uint64) string { return strconv.FormatUint(u, 10) }

// queuedBy returns a record's queued_by as {source: {priority: count}}.
func (r record) queuedBy() map[string]map[int64]uint64 {
	out := map[string]map[int64]uint64{}
	m, _ := r.m["queued_by"].(map[any]any)
	for k, v := range m {
		src, _ := k.(string)
		q, _ := v.(map[any]any)
		out[src] = map[int64]uint64{}
		for p, n := range q {
			pi, _ := toU64(p)
			ni, _ := toU64(n)
			out[src][int64(pi)] = ni
		}
	}
	return out
}

// TestContractVectorsRouterQueues: a monitor takes the valid router-queue
// vectors (contract §22) into the record's queued_by and queued, refuses
// the others, and forgets a router's queue 3 s after its report.
func TestContractVectorsRouterQueues(t *testing.T) {
	t.Parallel()
	v := loadVectors(t)
	if len(v.RouterQueues) == 0 {
		t.Fatal("no router_queues vectors")
	}
	_, c, kv := startMonitorKV(t, monOpt{})
	const model = "Qwen/Qwen3-0.6B"
	// Worker 7 keeps reporting: the model keeps its record.
	worker := newPub(t, c, model, 7)
	polls := 0
	alive := func() {
		if polls++; polls%10 == 1 {
			worker.report(0, f("active_decode_blocks", 0, "kv_total_blocks", 100))
		}
	}
	alive()
	waitRecord(t, kv, model, "worker 7 free", func(r record) bool { return r.has("free", 7) })
	for _, rv := range v.RouterQueues {
		if rv.Valid && rv.Name != v.RouterQueues[0].Name {
			continue // they share boot and seq: the first valid one stands for them
		}
		data, err := hex.DecodeString(rv.Hex)
		if err != nil {
			t.Fatal(err)
		}
		publish(t, c.nc, rv.Subject, data)
	}
	r := waitRecord(t, kv, model, "router/r-1's three standard requests", func(r record) bool {
		alive()
		return r.queuedBy()["router/r-1"][0] == 3
	})
	if q, _ := r.m["queued"].(map[any]any); len(q) != 1 || len(r.queuedBy()) != 1 || r.u64("routers") != 1 {
		t.Fatalf("queued %v, queued_by %v, routers %d; want the valid vector's only", r.m["queued"], r.queuedBy(), r.u64("routers"))
	}
	waitRecordFor(t, kv, model, "router/r-1's queue forgotten", 6*time.Second, func(r record) bool {
		alive()
		q, _ := r.m["queued"].(map[any]any)
		return len(r.queuedBy()) == 0 && q != nil && len(q) == 0 && r.u64("routers") == 0
	})
}
