package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/sim"
)

// DefaultSimHTTPAddr is where `workermon sim` serves /healthz and /metrics:
// a free loopback port, printed at start.
const DefaultSimHTTPAddr = "127.0.0.1:0"

// simOptions is everything `workermon sim` can be told.
type simOptions struct {
	natsURL      string
	fleet        sim.FleetConfig
	capacitySkew string
	speedSkew    string
	kill, mute   string
	publish      bool
	httpAddr     string
	log          logOptions
}

func (o *simOptions) flags(fs *flag.FlagSet) {
	natsFlags(fs, &o.natsURL, &o.fleet.NATS)
	f := &o.fleet
	fs.StringVar(&f.Model, "model", f.Model, "model the workers serve")
	fs.IntVar(&f.Workers, "workers", f.Workers, "number of workers")
	fs.Var(uint32Value{&f.Ranks}, "ranks", "data-parallel ranks per worker")
	fs.Uint64Var(&f.BaseWorkerID, "worker-id-base", f.BaseWorkerID, "id of the first worker; worker i has id base+i")
	fs.StringVar(&f.Host, "host", f.Host, "host the workers listen on")
	fs.IntVar(&f.BasePort, "port-base", f.BasePort, "port of the first worker; worker i listens on base+i (0: random ports)")
	fs.StringVar(&f.AdvertiseHost, "advertise-host", f.AdvertiseHost, "host in the endpoints registered for routers (needs --port-base)")
	fs.StringVar(&f.Publish.SubjectPrefix, "subject-prefix", f.Publish.SubjectPrefix, "first subject token(s) of load and goodbye subjects")
	fs.BoolVar(&o.publish, "publish", o.publish,
		"publish load and register through NATS; false: stay off NATS like a stock engine, for workermon scrape to read /metrics")
	fs.StringVar(&o.httpAddr, "http-addr", o.httpAddr,
		"listen address of the fleet's /healthz (with the NATS server's version) and /metrics (workermon_nats_server_info); empty: none")
	e := &f.Engine
	fs.StringVar(&e.Profile, "engine-profile", e.Profile,
		"simulated engine: "+strings.Join(sim.EngineProfiles(), ", ")+"; --kv-blocks, --block-size, --max-batched-tokens, --max-num-seqs, --prefill-speed and --decode-speed replace its values when set")
	fs.IntVar(&e.KVBlocks, "kv-blocks", e.KVBlocks, "KV-cache blocks per rank (0: the profile's)")
	fs.IntVar(&e.BlockSize, "block-size", e.BlockSize, "tokens per KV block (0: the profile's)")
	fs.IntVar(&e.MaxNumBatchedTokens, "max-batched-tokens", e.MaxNumBatchedTokens,
		"a step's token budget, decodes and prefill chunks (0: the profile's)")
	fs.IntVar(&e.MaxNumSeqs, "max-num-seqs", e.MaxNumSeqs, "most requests running at once per rank (0: the profile's, 256 but in llama70b-2xh100)")
	fs.Float64Var(&e.PrefillSpeed, "prefill-speed", e.PrefillSpeed, "prompt tokens per second a step computes (0: the profile's)")
	fs.Float64Var(&e.DecodeSpeed, "decode-speed", e.DecodeSpeed,
		"tokens per second of a request decoding alone; a larger batch decodes slower (0: the profile's)")
	fs.StringVar(&o.capacitySkew, "capacity-skew", "", "per-rank factors on capacity, comma-separated (e.g. 1,0.5)")
	fs.StringVar(&o.speedSkew, "speed-skew", "", "per-rank factors on speed, comma-separated")
	fs.StringVar(&o.kill, "kill", "", "workers that crash, as id@delay, comma-separated (e.g. 2@30s): no goodbye, HTTP down")
	fs.StringVar(&o.mute, "mute", "", "workers that stop reporting but keep serving, as id@delay, comma-separated")
	o.log.flags(fs)
}

// faults parses "id@delay,id@delay".
func faults(s string) (map[uint64]time.Duration, error) {
	out := map[uint64]time.Duration{}
	for part := range strings.SplitSeq(s, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		idText, delayText, ok := strings.Cut(part, "@")
		id, err := strconv.ParseUint(idText, 10, 64)
		if !ok || err != nil {
			return nil, fmt.Errorf("%w: %q: want worker-id@delay, e.g. 2@30s", errUsage, part)
		}
		d, err := time.ParseDuration(delayText)
		if err != nil || d < 0 {
			return nil, fmt.Errorf("%w: %q: bad delay", errUsage, part)
		}
		out[id] = d
	}
	return out, nil
}

func merged(a, b map[uint64]time.Duration) map[uint64]time.Duration {
	out := maps.Clone(a)
	maps.Copy(out, b)
	return out
}

func floats(s string) ([]float64, error) {
	var out []float64
	for part := range strings.SplitSeq(s, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		v, err := strconv.ParseFloat(part, 64)
		if err != nil {
			return nil, fmt.Errorf("%w: %q is not a number", errUsage, part)
		}
		out = append(out, v)
	}
	return out, nil
}

// prepare completes the fleet's configuration from the flags, validates it
// and returns the workers to kill and to mute.
func (o *simOptions) prepare() (kills, mutes map[uint64]time.Duration, err error) {
	o.fleet.NATS.URL = o.natsURL
	o.fleet.Publish.Disabled = !o.publish
	if o.fleet.Engine.CapacitySkew, err = floats(o.capacitySkew); err != nil {
		return nil, nil, err
	}
	if o.fleet.Engine.SpeedSkew, err = floats(o.speedSkew); err != nil {
		return nil, nil, err
	}
	if kills, err = faults(o.kill); err != nil {
		return nil, nil, err
	}
	if mutes, err = faults(o.mute); err != nil {
		return nil, nil, err
	}
	if err := o.fleet.Validate(); err != nil {
		return nil, nil, err
	}
	if o.httpAddr != "" {
		if err := validListenAddr("http-addr", o.httpAddr); err != nil {
			return nil, nil, fmt.Errorf("%w: sim: %w", errUsage, err)
		}
	}
	for id := range merged(kills, mutes) {
		if id < o.fleet.BaseWorkerID || id-o.fleet.BaseWorkerID >= uint64(o.fleet.Workers) {
			return nil, nil, fmt.Errorf("%w: --kill/--mute name worker %d, which is not in the fleet", errUsage, id)
		}
	}
	return kills, mutes, nil
}

func runSim(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := simOptions{fleet: sim.DefaultFleetConfig(), publish: true, httpAddr: DefaultSimHTTPAddr, log: defaultLogOptions()}
	o.natsURL = natsconn.DefaultURL
	log, check, err := parseCommand("sim", args, stderr, natsURLEnv, o.flags, &o.log)
	if err != nil {
		return err
	}
	kills, mutes, err := o.prepare()
	if check.on {
		return check.report(stdout, err, nil)
	}
	if err != nil {
		return err
	}
	// The fleet's own connection: the server check (contract §14) before any
	// worker starts, and the version for /healthz and /metrics.
	reg := newRegistry()
	var nc *nats.Conn
	if o.publish {
		c := o.fleet.NATS
		if c.Name == natsconn.DefaultName {
			c.Name = "workermon-sim"
		}
		if nc, err = natsconn.Connect(ctx, c, log.With("component", "nats")); err != nil {
			return err
		}
		defer nc.Close()
		if err := checkServer(ctx, nc, reg); err != nil {
			return err
		}
	}
	fleet, err := sim.NewFleet(ctx, o.fleet, log)
	if err != nil {
		return err
	}
	var srv *httpServer
	if o.httpAddr != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("GET /healthz", healthz(nc))
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		if srv, err = startHTTP("sim", o.httpAddr, mux, log); err != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), DefaultShutdownTimeout)
			defer cancel()
			return errors.Join(err, fleet.Close(cctx))
		}
		fmt.Fprintf(stdout, "workermon sim: http://%s (/healthz, /metrics)\n", srv.addr)
	}
	if step, err := o.fleet.Engine.Step(); err == nil {
		fmt.Fprintf(stdout, "engine profile %s: %d KV blocks of %d tokens per rank, budget %d tokens, %d sequences, %.0f tokens/s alone, prefill %.0f tokens/s\n",
			o.fleet.Engine.Profile, step.KVBlocks, step.BlockSize, step.MaxBatchedTokens, step.MaxNumSeqs, step.DecodeSpeed(), step.PrefillSpeed())
	}
	for _, w := range fleet.Workers() {
		fmt.Fprintf(stdout, "worker %d of %s: %s (%d ranks)\n", w.ID(), w.Model(), w.Endpoint(), o.fleet.Ranks)
	}
	for id, d := range kills {
		if w := fleet.Worker(id); w != nil {
			t := time.AfterFunc(d, func() { log.Warn("killing worker (--kill)", "worker_id", id); w.Kill() })
			defer t.Stop()
		}
	}
	for id, d := range mutes {
		if w := fleet.Worker(id); w != nil {
			t := time.AfterFunc(d, func() { log.Warn("muting worker (--mute)", "worker_id", id); w.Mute() })
			defer t.Stop()
		}
	}
	return closeWhenDone(ctx, log, "closing the fleet: goodbyes, then draining in-flight requests", func(ctx context.Context) error {
		err := fleet.Close(ctx)
		if srv != nil {
			err = errors.Join(err, srv.shutdown(ctx))
		}
		return err
	})
}
