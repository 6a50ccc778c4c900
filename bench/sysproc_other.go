//go:build !linux

package bench

import "syscall"

// sysProcAttr: nothing to set here.
func sysProcAttr() *syscall.SysProcAttr { return nil }
