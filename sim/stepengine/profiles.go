package stepengine

import (
	"fmt"
	"time"
)

// Names of the engine profiles.
const (
	// ProfileDemo is today's simulated scale, so that the demo and compose
	// keep their shape: 256 blocks of 16 tokens, a 2048-token budget, 50
	// tokens/s for a request decoding alone. The default.
	ProfileDemo = "demo"
	// ProfileTiny is a small KV cache and millisecond steps: a rank
	// saturates at a few chat requests per second, so that a goodput
	// benchmark is cheap on 2 cores. No time compression.
	ProfileTiny = "tiny"
	// ProfileLlama70BH100 is calibrated to NVIDIA's published NIM
	// benchmark of Llama-3.3-70B-Instruct (FP8, TP2) on 2 × H100 80GB: one
	// rank is one such engine. docs/sim.md shows the source and the fit.
	ProfileLlama70BH100 = "llama70b-2xh100"
)

// DefaultProfile is the profile of a simulated engine given none.
const DefaultProfile = ProfileDemo

// SLO is a pair of latency targets that suit a profile: a request is good
// when its time to first token is at most TTFT and its time per output token
// at most ITL.
type SLO struct {
	TTFT, ITL time.Duration
}

// Profile is a named engine configuration with the latency targets that
// suit it.
type Profile struct {
	Name string
	// Summary says in a line what the profile stands for.
	Summary string
	Config  Config
	SLO     SLO
}

// Profiles returns every profile, the default first.
func Profiles() []Profile {
	return []Profile{
		{
			Name:    ProfileDemo,
			Summary: "today's simulated scale: 256 blocks of 16 tokens, 50 tokens/s alone",
			Config:  DefaultConfig(),
			SLO:     SLO{TTFT: 2 * time.Second, ITL: 50 * time.Millisecond},
		},
		{
			Name:    ProfileTiny,
			Summary: "512 blocks of 16 tokens, millisecond steps: saturates at a few chat requests/s",
			Config: Config{
				KVBlocks:         512,
				BlockSize:        16,
				MaxBatchedTokens: 2048,
				MaxNumSeqs:       DefaultMaxNumSeqs,
				StepBase:         12 * time.Millisecond,
				PrefillPerToken:  62500 * time.Nanosecond, // 16,000 tokens/s
				DecodePerRequest: 500 * time.Microsecond,
				ContextPerToken:  2 * time.Microsecond,
			},
			SLO: SLO{TTFT: time.Second, ITL: 50 * time.Millisecond},
		},
		{
			Name:    ProfileLlama70BH100,
			Summary: "Llama-3.3-70B-Instruct FP8 TP2 on 2 x H100 80GB (NVIDIA NIM 1.8.0 benchmark)",
			Config: Config{
				KVBlocks:         30000, // 480,000 tokens
				BlockSize:        16,
				MaxBatchedTokens: 8192, // vLLM V1's default on a GPU of 70 GiB or more
				MaxNumSeqs:       1024, // likewise
				StepBase:         18390 * time.Microsecond,
				PrefillPerToken:  77800 * time.Nanosecond, // 12,850 tokens/s
				DecodePerRequest: 10 * time.Microsecond,
				ContextPerToken:  35 * time.Nanosecond,
			},
			SLO: SLO{TTFT: 2 * time.Second, ITL: 100 * time.Millisecond},
		},
	}
}

// LookupProfile returns the profile of that name, or ErrUnknownProfile.
func LookupProfile(name string) (Profile, error) {
	for _, p := range Profiles() {
		if p.Name == name {
			return p, nil
		}
	}
	return Profile{}, fmt.Errorf("stepengine: look up profile %q: %w", name, ErrUnknownProfile)
}

// ProfileNames returns the names of every profile, the default first.
func ProfileNames() []string {
	ps := Profiles()
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	return names
}
