package bench

import "syscall"

// sysProcAttr makes a child die with the parent (SIGTERM), so that no
// monitor outlives a killed run.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
}
