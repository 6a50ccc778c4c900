package main

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/overrides"
)

// TestCordonAPIAndRestart cordons a worker through the API and the CLI: the
// record lists it busy with reason "cordoned" at once, GET /cordons lists
// it, a monitor started afterwards on the same NATS keeps it cordoned, and
// uncordon frees it.
func TestCordonAPIAndRestart(t *testing.T) {
	t.Parallel()
	dataDir := t.TempDir()
	svc := testService(t, func(o *serveOptions) {
		longLived(o)
		o.adminToken = e2eToken
		o.embedded.DataDir = dataDir
	})
	nc, busy := connect(t, svc.natsURL)
	publishReport(t, nc, e2eModel, 7, 10, 100)
	publishReport(t, nc, e2eModel, 8, 10, 100)
	natstest.WaitFor(t, 10*time.Second, "both workers free", func() bool {
		b, ok := record(t, busy, e2eModel)
		return ok && slices.Equal(b.Free, []uint64{7, 8})
	})

	// Without the token: refused, nothing stored.
	if code, _, body := call(t, svc, "POST", "/cordon", "", `{"model":"`+e2eModel+`","worker_id":8}`); code != http.StatusUnauthorized {
		t.Fatalf("cordon without token = %d %s, want 401", code, body)
	}
	// Contract §8: out of range 400, wrong type 422.
	for _, bad := range []struct {
		body string
		want int
	}{
		{`{"model":"` + e2eModel + `"}`, http.StatusBadRequest},
		{`{"worker_id":8}`, http.StatusBadRequest},
		{`{"model":"` + e2eModel + `","worker_id":-1}`, http.StatusBadRequest},
		{`{"model":"` + e2eModel + `","worker_id":2e19}`, http.StatusBadRequest},
		{`{"model":"` + e2eModel + `","worker_id":1.5}`, http.StatusBadRequest},
		{`{"model":"` + e2eModel + `","worker_id":"8"}`, http.StatusUnprocessableEntity},
	} {
		if code, _, body := call(t, svc, "POST", "/cordon", e2eToken, bad.body); code != bad.want {
			t.Errorf("cordon %s = %d %s, want %d", bad.body, code, body, bad.want)
		}
	}
	for _, bad := range []string{`{"model":"` + e2eModel + `","worker_id":8,"x":1}`, `[]`} {
		if code, _, body := call(t, svc, "POST", "/cordon", e2eToken, bad); code < 400 || code >= 500 {
			t.Errorf("cordon %s = %d %s, want a 4xx", bad, code, body)
		}
	}
	code, _, body := call(t, svc, "POST", "/cordon", e2eToken, `{"model":"`+e2eModel+`","worker_id":8}`)
	var c overrides.Cordon
	if code != http.StatusOK || json.Unmarshal(body, &c) != nil || c.Model != e2eModel || c.WorkerID != 8 || c.CordonedAt == 0 {
		t.Fatalf("cordon = %d %s", code, body)
	}
	natstest.WaitFor(t, 5*time.Second, "worker 8 cordoned in the record", func() bool {
		b, _ := record(t, busy, e2eModel)
		return slices.Equal(b.Busy, []uint64{8}) && b.Reasons["8"] == "cordoned" && slices.Equal(b.Free, []uint64{7})
	})
	code, _, body = call(t, svc, "GET", "/cordons", "", "")
	var list []overrides.Cordon
	if code != http.StatusOK || json.Unmarshal(body, &list) != nil || len(list) != 1 || list[0].WorkerID != 8 {
		t.Fatalf("cordons = %d %s", code, body)
	}
	// The CLI cordons a worker the monitor has not seen yet.
	url := "--monitor-url=http://" + svc.httpAddr
	if code, out, errOut := runCLI(t, "cordon", url, "--admin-token", e2eToken, "--model", e2eModel, "--worker-id", "9"); code != 0 ||
		!strings.Contains(out, "cordoned worker 9") {
		t.Fatalf("cordon CLI: exit %d %s %s", code, out, errOut)
	}
	if code, out, _ := runCLI(t, "cordon", url); code != 0 || !strings.Contains(out, e2eModel) || strings.Count(out, "\n") != 3 {
		t.Fatalf("cordon list CLI: exit %d\n%s", code, out)
	}

	// A new monitor on the same NATS sees the cordons from the bucket.
	addr := svc.embedded.ClientURL()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := svc.Close(ctx); err != nil {
		t.Fatal(err)
	}
	svc2 := testService(t, func(o *serveOptions) {
		longLived(o)
		o.adminToken = e2eToken
		o.embedded.DataDir = dataDir
		o.embedded.Addr = strings.TrimPrefix(addr, "nats://")
	})
	nc2, busy2 := connect(t, svc2.natsURL)
	publishReport(t, nc2, e2eModel, 7, 10, 100)
	publishReport(t, nc2, e2eModel, 8, 10, 100)
	publishReport(t, nc2, e2eModel, 9, 10, 100)
	natstest.WaitFor(t, 10*time.Second, "8 and 9 cordoned after the restart", func() bool {
		b, _ := record(t, busy2, e2eModel)
		return slices.Equal(b.Busy, []uint64{8, 9}) && b.Reasons["9"] == "cordoned" && slices.Equal(b.Free, []uint64{7})
	})

	code, _, body = call(t, svc2, "POST", "/uncordon", e2eToken, `{"model":"`+e2eModel+`","worker_id":8}`)
	var u api.UncordonReply
	if code != http.StatusOK || json.Unmarshal(body, &u) != nil || !u.WasCordoned {
		t.Fatalf("uncordon = %d %s", code, body)
	}
	natstest.WaitFor(t, 5*time.Second, "worker 8 free again", func() bool {
		b, _ := record(t, busy2, e2eModel)
		return slices.Equal(b.Busy, []uint64{9}) && slices.Equal(b.Free, []uint64{7, 8})
	})
	url = "--monitor-url=http://" + svc2.httpAddr
	if code, out, _ := runCLI(t, "uncordon", url, "--admin-token", e2eToken, "--model", e2eModel, "--worker-id", "8"); code != 0 ||
		!strings.Contains(out, "was not cordoned") {
		t.Errorf("second uncordon: exit %d %s", code, out)
	}
	code, _, body = call(t, svc2, "GET", "/rescheduler", "", "")
	if code != http.StatusOK || !strings.Contains(string(body), `"enabled":false`) {
		t.Errorf("rescheduler = %d %s", code, body)
	}
}
