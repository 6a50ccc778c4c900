//go:build !linux

package bench

import "time"

// processCPU is unknown here.
func processCPU(int) time.Duration { return 0 }

// processRSSMB is unknown here.
func processRSSMB(int) float64 { return 0 }

// cpuSample is unknown here.
type cpuSample struct{}

func hostCPU() cpuSample { return cpuSample{} }

func (cpuSample) busyPct(cpuSample) float64 { return 0 }
