package main

import (
	"context"
	"io"
	"net/http"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/natsconn"
)

// serverCheckTimeout bounds the JetStream probe of checkServer.
const serverCheckTimeout = 5 * time.Second

// checkServer refuses a NATS server workermon cannot work with (contract
// §14: too old, or JetStream off) and exports the connected server's
// version as workermon_nats_server_info.
func checkServer(ctx context.Context, nc *nats.Conn, reg prometheus.Registerer) error {
	ctx, cancel := context.WithTimeout(ctx, serverCheckTimeout)
	defer cancel()
	if err := natsconn.CheckServer(ctx, nc); err != nil {
		return err
	}
	return reg.Register(natsconn.ServerInfo(nc))
}

// healthz answers "ok" and the version of the NATS server the process is
// connected to ("disconnected" while it is not, "none" when nc is nil: the
// process uses no NATS), then the lines each of extra writes.
func healthz(nc *nats.Conn, extra ...func(io.Writer)) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		version := "disconnected"
		switch {
		case nc == nil:
			version = "none"
		case nc.IsConnected():
			version = nc.ConnectedServerVersion()
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\nnats_server_version " + version + "\n"))
		for _, fn := range extra {
			fn(w)
		}
	}
}
