//go:build !unix

package bench

import "time"

// selfCPU is 0 where the process's CPU time is not read.
func selfCPU() time.Duration { return 0 }
