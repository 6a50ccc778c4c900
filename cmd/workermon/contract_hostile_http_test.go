package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// Hostile and malformed HTTP requests to the monitor (issue 23, items 18,
// 21 and 24): each answers with its status and the JSON error, and none widens
// an answer or grows the monitor's state without bound.

// maxCordons is overrides.DefaultMaxCordons: POST /cordon refuses a new
// cordon with 429 once the bucket holds this many.
const maxCordons = 1024

func TestContractHostileMonitorHTTP(t *testing.T) {
	t.Parallel()
	m := startMonitor(t, monOpt{})

	t.Run("wrong method is 405 with Allow", func(t *testing.T) {
		for _, path := range []string{"/partitions", "/metrics", "/healthz", "/readyz"} {
			for _, method := range []string{"POST", "PUT", "DELETE"} {
				h := doHTTP(t, method, m.base+path, "", nil)
				checkAPIError(t, method+" "+path, h, http.StatusMethodNotAllowed)
				if allow := h.header.Get("Allow"); allow != "GET, HEAD" {
					t.Errorf("%s %s: Allow %q, want \"GET, HEAD\"", method, path, allow)
				}
			}
			if h := doHTTP(t, "GET", m.base+path, "", nil); h.code != http.StatusOK {
				t.Errorf("GET %s: %d %s", path, h.code, h.body)
			}
		}
	})

	t.Run("a model query that does not name one model is 400", func(t *testing.T) {
		for _, path := range []string{"/loads", "/workers", "/busy"} {
			for _, query := range []string{"?model=%zz", "?model=", "?model=a%", "?model=%zz&model=", "?x=%zz&model=a"} {
				checkAPIError(t, "GET "+path+query, doHTTP(t, "GET", m.base+path+query, "", nil), http.StatusBadRequest)
			}
			long := doHTTP(t, "GET", m.base+path+"?model="+strings.Repeat("m", 100<<10), "", nil)
			checkAPIError(t, "GET "+path+" with a 100 KiB model", long, http.StatusBadRequest)
			if len(long.body) > 1024 {
				t.Errorf("GET %s with a 100 KiB model: the 400 is %d bytes: it repeats the name", path, len(long.body))
			}
			if h := doHTTP(t, "GET", m.base+path, "", nil); h.code != http.StatusOK {
				t.Errorf("GET %s without a model: %d %s", path, h.code, h.body)
			}
			if h := doHTTP(t, "GET", m.base+path+"?model=some%2Fmodel", "", nil); h.code != http.StatusOK {
				t.Errorf("GET %s?model=some%%2Fmodel: %d %s", path, h.code, h.body)
			}
		}
	})

	t.Run("cordons are capped", func(t *testing.T) {
		c := m.client(t)
		kv := c.kv(t, "workermon-cordons")
		// Fill the bucket to the cap directly: a cordon may name a worker
		// nobody has seen (contract §12), so names cost nothing to invent.
		model := strings.Repeat("c", 200)
		for i := range maxCordons {
			b, _ := json.Marshal(map[string]any{"model": model, "worker_id": i, "cordoned_at": 1})
			if _, err := kv.Put(context.Background(), modelKey(model)+fmt.Sprintf(".%d", i), b); err != nil {
				t.Fatal(err)
			}
		}
		post := func(path, model string, id int) httpResp {
			body, _ := json.Marshal(map[string]any{"model": model, "worker_id": id})
			return doHTTP(t, "POST", m.base+path, "application/json", body)
		}
		checkAPIError(t, "a new cordon beyond the cap", post("/cordon", "unseen/model", 1), http.StatusTooManyRequests)
		checkAPIError(t, "a new worker of a cordoned model beyond the cap", post("/cordon", model, maxCordons), http.StatusTooManyRequests)
		if h := post("/cordon", model, 5); h.code != http.StatusOK {
			t.Errorf("cordoning a cordoned worker again at the cap: %d %s", h.code, h.body)
		}
		if h := post("/uncordon", model, 5); h.code != http.StatusOK {
			t.Fatalf("uncordon: %d %s", h.code, h.body)
		}
		if h := post("/cordon", "unseen/model", 1); h.code != http.StatusOK {
			t.Errorf("a new cordon below the cap: %d %s", h.code, h.body)
		}
		checkAPIError(t, "the next one beyond the cap again", post("/cordon", "unseen/model", 2), http.StatusTooManyRequests)
	})
}

// TestContractHostileRouterHTTP: model names the contract refuses are 400
// before anything else, and never echoed whole (issue 23, item 21); a
// priority header given twice is 400 (item 25).
func TestContractHostileRouterHTTP(t *testing.T) {
	t.Parallel()
	natsURL, _, wkv := routerNATS(t)
	r := startRouter(t, natsURL)
	model := newModel(t)
	registerEngines(t, wkv, model, newEngine(t, 1, nil))

	t.Run("model names over 256 bytes or not UTF-8 are 400", func(t *testing.T) {
		for _, c := range []struct {
			what string
			body string
		}{
			{"257 bytes", fmt.Sprintf(`{"model":%q,"prompt":"hi"}`, strings.Repeat("m", 257))},
			{"1 MiB", fmt.Sprintf(`{"model":%q,"prompt":"hi"}`, strings.Repeat("m", 1<<20))},
			{"3 MiB of escapes", `{"model":"` + strings.Repeat(`\u00e9`, 1<<19) + `","prompt":"hi"}`},
			{"invalid UTF-8", "{\"model\":\"bad\xff\xfe\",\"prompt\":\"hi\"}"},
		} {
			h := doHTTP(t, "POST", r.base+"/v1/completions", "application/json", []byte(c.body))
			checkRouterError(t, c.what, h, http.StatusBadRequest)
			if len(h.body) > 1024 {
				t.Errorf("%s: the 400 is %d bytes: it repeats the name", c.what, len(h.body))
			}
		}
		// 256 bytes is a name: an unknown one is "no workers available".
		h := completion(t, r.base, "/v1/completions", strings.Repeat("é", 128))
		checkNoWorkers(t, "unknown model of 256 bytes", h)
	})

	t.Run("a repeated priority header is 400", func(t *testing.T) {
		for _, values := range [][]string{{"1", "1"}, {"-1", "1"}, {"0", ""}} {
			req, err := http.NewRequest("POST", r.base+"/v1/completions",
				strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"hi"}`, model)))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "application/json")
			for _, v := range values {
				req.Header.Add("X-Workermon-Priority", v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			m := checkRouterError(t, fmt.Sprintf("priority %q", values), httpResp{code: resp.StatusCode, header: resp.Header, body: b}, http.StatusBadRequest)
			if s, _ := m["message"].(string); !strings.Contains(s, "X-Workermon-Priority") {
				t.Errorf("priority %q: message %q does not name the header", values, s)
			}
		}
		if h := completion(t, r.base, "/v1/completions", model); h.code != http.StatusOK {
			t.Errorf("one priority header: %d %s", h.code, h.body)
		}
	})
}
