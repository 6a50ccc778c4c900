//go:build !linux

package bench

import "time"

// processCPU is unknown here.
func processCPU(int) time.Duration { return 0 }

// processRSSMB is unknown here.
func processRSSMB(int) float64 { return 0 }
