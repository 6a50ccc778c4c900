package main

import (
	"log/slog"
	"net/http"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/workermon/workermon/board"
)

// startBoard starts the web board over src, with the default settings.
func startBoard(src board.Source, log *slog.Logger, reg prometheus.Registerer) (*board.Board, error) {
	cfg := board.DefaultConfig()
	cfg.Source = src
	cfg.Logger = log.With("component", "board")
	cfg.Registerer = reg
	return board.New(cfg)
}

// mountBoard serves the board's paths (the page at /) on mux.
func mountBoard(mux *http.ServeMux, b *board.Board) {
	for _, p := range board.Patterns {
		mux.Handle(p, b)
	}
}

// lateCounter is a board.Counter set after the board starts: the demo's
// monitor shows the counts of a router that starts after it. Unset, it
// counts nothing (the page shows no rejections).
type lateCounter struct {
	c atomic.Pointer[board.Counter]
	q atomic.Pointer[board.QueueCounter]
}

func (l *lateCounter) set(c board.Counter) { l.c.Store(&c) }

func (l *lateCounter) count() (rejected, outcomes map[string]uint64, err error) {
	if c := l.c.Load(); c != nil {
		return (*c)()
	}
	return nil, nil, nil
}

func (l *lateCounter) setQueues(q board.QueueCounter) { l.q.Store(&q) }

func (l *lateCounter) queues() (map[string]uint64, error) {
	if q := l.q.Load(); q != nil {
		return (*q)()
	}
	return nil, nil
}
