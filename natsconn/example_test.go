package natsconn_test

import (
	"context"
	"log/slog"
	"os"
	"os/signal"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/natsconn"
)

// A service that needs NATS: start the embedded server when no URL is
// given, then wait for the connection until Ctrl-C.
func ExampleConnect() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	log := slog.Default()

	natsURL := "" // from --nats-url or NATS_URL; empty: embedded server

	cfg := natsconn.DefaultConfig()
	if natsURL != "" {
		cfg.URL = natsURL
	} else {
		ecfg := natsconn.DefaultEmbeddedConfig()
		ecfg.Logger = log
		emb, err := natsconn.StartEmbedded(ctx, ecfg)
		if err != nil {
			log.Error("start embedded NATS", "error", err)
			return
		}
		defer emb.Close()
		cfg.URL = emb.ClientURL()
	}
	nc, err := natsconn.Connect(ctx, cfg, log)
	if err != nil {
		log.Error("connect to NATS", "error", err)
		return
	}
	defer nc.Close() // before emb.Close: deferred calls run last first
}

// A KV watcher that re-watches after every reconnect, resuming after the
// last revision it has seen.
func ExampleConnect_rewatch() {
	ctx := context.Background()
	nc, err := natsconn.Connect(ctx, natsconn.DefaultConfig(), nil)
	if err != nil {
		return
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, "workermon-busy")
	if err != nil {
		return
	}

	// Register before the first watch, so no reconnect is missed.
	reconnected := nc.StatusChanged(nats.CONNECTED)
	defer nc.RemoveStatusListener(reconnected)

	var last uint64
	watch := func() (jetstream.KeyWatcher, error) {
		if last == 0 {
			return kv.WatchAll(ctx)
		}
		return kv.WatchAll(ctx, jetstream.ResumeFromRevision(last+1))
	}
	w, err := watch()
	if err != nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			w.Stop()
			return
		case <-reconnected:
			w.Stop()
			if w, err = watch(); err != nil {
				return // a real watcher retries with backoff
			}
		case e, ok := <-w.Updates():
			if !ok {
				return // a real watcher re-watches with backoff
			}
			if e == nil || e.Revision() <= last {
				continue // end of initial values, or seen already
			}
			last = e.Revision()
			// use e
		}
	}
}
