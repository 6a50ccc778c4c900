package natsconn

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"syscall"
	"testing"
)

func TestServerLoggerLevels(t *testing.T) {
	t.Parallel()
	logs := newCapture(LevelTrace)
	l := newServerLogger(logs.logger())
	l.Noticef("notice %d", 1)
	l.Warnf("warn %d", 2)
	l.Errorf("error %d", 3)
	l.Debugf("debug %d", 4)
	l.Tracef("trace %d", 5)
	for _, want := range []struct {
		level slog.Level
		msg   string
	}{
		{slog.LevelInfo, "notice 1"},
		{slog.LevelWarn, "warn 2"},
		{slog.LevelError, "error 3"},
		{slog.LevelDebug, "debug 4"},
		{LevelTrace, "trace 5"},
	} {
		if n := len(logs.records(want.level, want.msg)); n != 1 {
			t.Errorf("%v %q logged %d times", want.level, want.msg, n)
		}
	}
	select {
	case err := <-l.fatal:
		t.Errorf("fatal error reported without Fatalf: %v", err)
	default:
	}
}

func TestServerLoggerFiltersByLevel(t *testing.T) {
	t.Parallel()
	logs := newCapture(slog.LevelInfo)
	l := newServerLogger(logs.logger())
	l.Debugf("debug")
	l.Tracef("trace")
	l.Noticef("notice")
	if got := logs.all(); len(got) != 1 || got[0].Msg != "notice" {
		t.Errorf("records = %v, want the notice only", got)
	}
}

func TestServerLoggerFatal(t *testing.T) {
	t.Parallel()
	logs := newCapture(slog.LevelInfo)
	l := newServerLogger(logs.logger())
	inUse := &net.OpError{Op: "listen", Net: "tcp", Err: os.NewSyscallError("bind", syscall.EADDRINUSE)}
	l.Fatalf("Error listening on port: %s, %q", "127.0.0.1:4222", inUse)
	l.Fatalf("second fatal error") // must not block

	recs := logs.records(slog.LevelError, `Error listening on port: 127.0.0.1:4222, "listen tcp: bind: address already in use"`)
	if len(recs) != 1 || recs[0].Attrs["fatal"] != "true" {
		t.Fatalf("records = %v", logs.all())
	}
	err := <-l.fatal
	if !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("fatal error %v does not wrap EADDRINUSE", err)
	}
	if err.Error() != recs[0].Msg {
		t.Errorf("fatal error = %q, want the logged message", err)
	}
}
