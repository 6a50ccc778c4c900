package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/slots"
	"github.com/workermon/workermon/slots/slotsnats"
)

// estimateOptions are the flags of a slot tracker's NATS side, shared by
// `workermon router` and `workermon slots` (contract §11).
type estimateOptions struct {
	publish       bool   // send the tracker's loads as router/<id> estimates
	blockSize     uint   // of a registry entry without block_size
	subjectPrefix string // of the est subjects
}

func defaultEstimateOptions(publish bool) estimateOptions {
	return estimateOptions{publish: publish, blockSize: slotsnats.DefaultBlockSize, subjectPrefix: events.DefaultSubjectPrefix}
}

func (o *estimateOptions) flags(fs *flag.FlagSet, publishFlag, publishHelp string) {
	fs.BoolVar(&o.publish, publishFlag, o.publish, publishHelp)
	fs.UintVar(&o.blockSize, "block-size", o.blockSize,
		"tokens per KV block of a registered worker whose registry entry names none")
	fs.StringVar(&o.subjectPrefix, "subject-prefix", o.subjectPrefix, "first subject token(s) of the estimate subjects")
}

func (o estimateOptions) validate() error {
	if o.blockSize == 0 || o.blockSize > 1<<16 {
		return fmt.Errorf("--block-size %d must be 1 to 65536", o.blockSize)
	}
	if err := events.ValidatePrefix(o.subjectPrefix); err != nil {
		return fmt.Errorf("--subject-prefix: %w", err)
	}
	return nil
}

// trackerFlags are the flags of a slot tracker's state, shared by
// `workermon slots` and `workermon router` (contract §11).
func trackerFlags(fs *flag.FlagSet, c *slots.Config) {
	fs.DurationVar(&c.RequestTTL, "request-ttl", c.RequestTTL, "a tracked request older than this is dropped")
	fs.IntVar(&c.MaxTrackers, "max-trackers", c.MaxTrackers,
		"most (model, tenant) trackers; a registration beyond is refused (429)")
	fs.IntVar(&c.MaxWorkers, "max-workers", c.MaxWorkers, "most registered workers over all trackers (429 beyond)")
	fs.IntVar(&c.MaxTotalRanks, "max-ranks", c.MaxTotalRanks,
		"most data-parallel ranks of the registered workers over all trackers (429 beyond)")
	fs.IntVar(&c.MaxRequests, "max-requests", c.MaxRequests, "most active requests over all trackers (429 beyond)")
	fs.IntVar(&c.MaxHashesPerRequest, "max-hashes-per-request", c.MaxHashesPerRequest,
		"most sequence_hashes (block hashes) of one add or projection (413 beyond)")
	fs.IntVar(&c.MaxBlocks, "max-blocks", c.MaxBlocks,
		"most block hashes held by the active requests over all trackers, each request counting its distinct ones (429 beyond)")
}

// validTrackerID checks that id can name the estimates' source router/<id>.
func validTrackerID(id string) error {
	if id == "" {
		return fmt.Errorf("empty: the estimates need a source router/<id>")
	}
	if err := events.ValidateSource(events.RouterSourcePrefix + id); err != nil {
		return fmt.Errorf("%q cannot name the estimates' source: %w", id, err)
	}
	return nil
}

// slotsLink runs a tracker's NATS side: its workers from the registry and,
// with publish, its loads to the monitors. stop ends both, the estimates'
// goodbyes sent, before the NATS connection may close.
type slotsLink struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// startSlotsLink starts the link; id names the estimates' source
// router/<id>.
func startSlotsLink(o estimateOptions, tr *slots.Tracker, reg slotsnats.Registry, nc *nats.Conn, id string, log *slog.Logger) *slotsLink {
	ctx, cancel := context.WithCancel(context.Background())
	l := &slotsLink{cancel: cancel}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		cfg := slotsnats.DefaultSyncConfig()
		cfg.Tracker, cfg.Registry, cfg.BlockSize, cfg.Log = tr, reg, uint32(o.blockSize), log.With("component", "slots")
		if err := slotsnats.Sync(ctx, cfg); err != nil {
			log.Error("slots: workers not synced from the registry", "err", err)
		}
	}()
	if o.publish {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			cfg := slotsnats.DefaultEstimatesConfig()
			cfg.Conn, cfg.Tracker, cfg.ID, cfg.SubjectPrefix = nc, tr, id, o.subjectPrefix
			cfg.Log = log.With("component", "estimates")
			if err := slotsnats.Estimates(ctx, cfg); err != nil {
				log.Error("slots: estimates not published", "err", err)
			}
		}()
	}
	return l
}

// stop ends the link and waits for it; nil-safe and idempotent.
func (l *slotsLink) stop() {
	if l != nil {
		l.cancel()
		l.wg.Wait()
	}
}
