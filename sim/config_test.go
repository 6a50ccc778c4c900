package sim_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/workermon/workermon/sim"
)

func TestDefaultsValid(t *testing.T) {
	t.Parallel()
	if err := sim.DefaultWorkerConfig().Validate(); err != nil {
		t.Errorf("DefaultWorkerConfig: %v", err)
	}
	if err := sim.DefaultFleetConfig().Validate(); err != nil {
		t.Errorf("DefaultFleetConfig: %v", err)
	}
	if err := sim.DefaultFleetConfig().WorkerConfig(1).Validate(); err != nil {
		t.Errorf("a fleet's worker: %v", err)
	}
}

func TestWorkerConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		change func(*sim.WorkerConfig)
		fields []string // every one must be named
	}{
		{"model", func(c *sim.WorkerConfig) { c.Model = "" }, []string{"Model"}},
		{"ranks", func(c *sim.WorkerConfig) { c.Ranks = 0 }, []string{"Ranks"}},
		{"rank overflow", func(c *sim.WorkerConfig) { c.DPStart = math.MaxUint32 }, []string{"DPStart"}},
		{"addr", func(c *sim.WorkerConfig) { c.Addr = "nowhere" }, []string{"Addr"}},
		{"endpoint", func(c *sim.WorkerConfig) { c.Endpoint = "http://h:1/v1" }, []string{"Endpoint"}},
		{"engine", func(c *sim.WorkerConfig) {
			c.Engine.KVBlocks, c.Engine.BlockSize, c.Engine.Profile = -1, -1, "huge"
			c.Engine.DecodeSpeed, c.Engine.PrefillSpeed = math.NaN(), math.Inf(1)
		}, []string{"KVBlocks", "BlockSize", "Profile", "DecodeSpeed", "PrefillSpeed"}},
		{"skew", func(c *sim.WorkerConfig) {
			c.Engine.CapacitySkew = []float64{1}
			c.Engine.SpeedSkew = []float64{1, 0}
		}, []string{"CapacitySkew", "SpeedSkew"}},
		{"publish", func(c *sim.WorkerConfig) {
			c.Publish.Heartbeat, c.Publish.SubjectPrefix = 2e9, "a.*"
		}, []string{"Heartbeat", "SubjectPrefix"}},
		{"nats", func(c *sim.WorkerConfig) { c.NATS.URL = "" }, []string{"NATS"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := sim.DefaultWorkerConfig()
			tc.change(&cfg)
			err := cfg.Validate()
			if !errors.Is(err, sim.ErrInvalidConfig) {
				t.Fatalf("Validate: %v; want ErrInvalidConfig", err)
			}
			for _, f := range tc.fields {
				if !strings.Contains(err.Error(), f) {
					t.Errorf("error %q does not name %s", err, f)
				}
			}
			if _, err := sim.NewWorker(t.Context(), cfg, nil); !errors.Is(err, sim.ErrInvalidConfig) {
				t.Errorf("NewWorker: %v; want ErrInvalidConfig", err)
			}
		})
	}
}

func TestFleetConfigValidate(t *testing.T) {
	t.Parallel()
	cfg := sim.DefaultFleetConfig()
	cfg.Workers, cfg.Host, cfg.BasePort, cfg.Ranks = 0, "", -1, 0
	err := cfg.Validate()
	if !errors.Is(err, sim.ErrInvalidConfig) {
		t.Fatalf("Validate: %v; want ErrInvalidConfig", err)
	}
	for _, f := range []string{"Workers", "Host", "BasePort", "Ranks"} {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error %q does not name %s", err, f)
		}
	}
	cfg = sim.DefaultFleetConfig()
	cfg.BaseWorkerID = math.MaxUint64
	if err := cfg.Validate(); !errors.Is(err, sim.ErrInvalidConfig) {
		t.Errorf("overflowing ids: %v", err)
	}
}
