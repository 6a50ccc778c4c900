//go:build !unix

package natsconn

import (
	"fmt"
	"os"
	"path/filepath"
)

// lockDataDir opens the lock file of dir but takes no lock: on this system
// two embedded servers sharing a data dir are not detected.
func lockDataDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, lockFileName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file: %w", err)
	}
	return f, nil
}
