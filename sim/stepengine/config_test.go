package stepengine

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		modify func(*Config)
		fields []string
	}{
		{"default", func(*Config) {}, nil},
		{"no blocks", func(c *Config) { c.KVBlocks = 0 }, []string{"KVBlocks"}},
		{"blocks past the bound", func(c *Config) { c.KVBlocks = MaxKVBlocks + 1 }, []string{"KVBlocks"}}, // KVBlocks × BlockSize overflowed
		{"block size", func(c *Config) { c.BlockSize = MaxBlockSize + 1 }, []string{"BlockSize"}},
		{"budget and seqs", func(c *Config) { c.MaxBatchedTokens, c.MaxNumSeqs = 0, -1 }, []string{"MaxBatchedTokens", "MaxNumSeqs"}},
		{"step base", func(c *Config) { c.StepBase = 0 }, []string{"StepBase"}},
		{"negative costs", func(c *Config) { c.PrefillPerToken, c.DecodePerRequest, c.ContextPerToken = -1, -1, -1 },
			[]string{"PrefillPerToken", "DecodePerRequest", "ContextPerToken"}},
		{"free costs", func(c *Config) { c.PrefillPerToken, c.DecodePerRequest, c.ContextPerToken = 0, 0, 0 }, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := DefaultConfig()
			tt.modify(&c)
			err := c.Validate()
			if len(tt.fields) == 0 {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("Validate: %v, want ErrInvalidConfig", err)
			}
			for _, f := range tt.fields {
				if !strings.Contains(err.Error(), f) {
					t.Errorf("Validate: %v does not name %s", err, f)
				}
			}
			if _, err := New(c); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("New: %v, want ErrInvalidConfig", err)
			}
		})
	}
}

func TestSpeedOverrides(t *testing.T) {
	t.Parallel()
	base := DefaultConfig()
	if got := base.DecodeSpeed(); got < 49.99 || got > 50.01 {
		t.Fatalf("demo decode speed %v, want 50", got)
	}
	c, err := base.WithDecodeSpeed(100)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.StepTime(0, 1, 0); got != 10*time.Millisecond {
		t.Fatalf("batch-1 decode step at 100 tokens/s: %v, want 10ms", got)
	}
	// The shape is kept: every decode cost halves.
	if c.StepBase*2 != base.StepBase || c.DecodePerRequest*2 != base.DecodePerRequest || c.ContextPerToken*2 != base.ContextPerToken {
		t.Fatalf("scaled decode costs %+v from %+v", c, base)
	}
	if c.PrefillPerToken != base.PrefillPerToken {
		t.Fatal("decode speed changed the prefill cost")
	}
	c, err = base.WithPrefillSpeed(8000)
	if err != nil || c.PrefillPerToken != 125*time.Microsecond || c.PrefillSpeed() != 8000 {
		t.Fatalf("prefill speed 8000: %v, %v", c.PrefillPerToken, err)
	}
	for _, bad := range []float64{0, -1, math.Inf(1), math.NaN()} {
		if _, err := base.WithDecodeSpeed(bad); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("WithDecodeSpeed(%v): %v", bad, err)
		}
		if _, err := base.WithPrefillSpeed(bad); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("WithPrefillSpeed(%v): %v", bad, err)
		}
	}
}

func TestProfiles(t *testing.T) {
	t.Parallel()
	names := ProfileNames()
	if names[0] != DefaultProfile || !slices.Contains(names, ProfileTiny) || !slices.Contains(names, ProfileLlama70BH100) {
		t.Fatalf("profiles %v", names)
	}
	for _, p := range Profiles() {
		if err := p.Config.Validate(); err != nil {
			t.Errorf("profile %s: %v", p.Name, err)
		}
		if p.SLO.TTFT <= 0 || p.SLO.ITL <= 0 || p.Summary == "" {
			t.Errorf("profile %s: %+v", p.Name, p)
		}
		got, err := LookupProfile(p.Name)
		if err != nil || got.Name != p.Name {
			t.Errorf("LookupProfile(%s): %v", p.Name, err)
		}
	}
	if p, _ := LookupProfile(ProfileDemo); p.Config != DefaultConfig() {
		t.Errorf("demo profile %+v is not the default config", p.Config)
	}
	if _, err := LookupProfile("h200"); !errors.Is(err, ErrUnknownProfile) {
		t.Errorf("LookupProfile(h200): %v", err)
	}
}

// TestDemoKeepsTodaysScale pins the demo profile to the old simulator's
// defaults (sim/sim.go): 256 blocks of 16 tokens, a 2048-token budget, 50
// tokens/s for a request decoding alone.
func TestDemoKeepsTodaysScale(t *testing.T) {
	t.Parallel()
	c := DefaultConfig()
	if c.KVBlocks != 256 || c.BlockSize != 16 || c.MaxBatchedTokens != 2048 || c.StepTime(0, 1, 0) != 20*time.Millisecond {
		t.Fatalf("demo config %+v", c)
	}
}

func TestMetricBuckets(t *testing.T) {
	t.Parallel()
	for _, b := range []struct {
		name    string
		buckets []float64
		n       int
	}{{MetricTTFT, TTFTBuckets(), 22}, {MetricITL, ITLBuckets(), 19}, {MetricE2E, E2EBuckets(), 21}} {
		if len(b.buckets) != b.n || !slices.IsSorted(b.buckets) {
			t.Errorf("%s: %d bounds %v, want %d increasing", b.name, len(b.buckets), b.buckets, b.n)
		}
	}
	for _, name := range []string{MetricTTFT, MetricITL, MetricITLLegacy, MetricE2E, MetricWaiting, MetricRunning, MetricPreemptions} {
		if !strings.HasPrefix(name, "vllm:") {
			t.Errorf("metric %s", name)
		}
	}
}
