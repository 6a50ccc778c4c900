//go:build unix

package natsconn

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// lockDataDir takes an exclusive lock on dir, so that two embedded servers
// (nats-server itself does not check) never share a JetStream store. The lock
// is held until the returned file is closed, or the process ends.
func lockDataDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, lockFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s: %w (is another workermon using it?)", dir, ErrDataDirInUse)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return f, nil
}
