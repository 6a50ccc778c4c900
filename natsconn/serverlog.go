package natsconn

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/nats-io/nats-server/v2/server"
)

// LevelTrace is the slog level of nats-server's protocol traces, below
// Debug. Traces show every protocol line, message payloads included, so the
// embedded server traces only when its logger is enabled at this level;
// debug logs need slog.LevelDebug.
const LevelTrace = slog.LevelDebug - 4

// serverLogger routes nats-server's logs to slog: notices at Info, warnings
// at Warn, errors and fatal errors at Error, debug at Debug, traces at
// LevelTrace. nats-server calls Fatalf when it cannot start (a port in use, a
// store it cannot open) and expects the process to end; serverLogger reports
// the error to StartEmbedded instead.
type serverLogger struct {
	log   *slog.Logger
	fatal chan error // the first fatal error; buffered, never blocks
}

var _ server.Logger = (*serverLogger)(nil)

func newServerLogger(log *slog.Logger) *serverLogger {
	return &serverLogger{log: log, fatal: make(chan error, 1)}
}

// install makes l the logger of s, enabling nats-server's debug and trace
// output only when l's handler would keep it.
func (l *serverLogger) install(s *server.Server) {
	ctx := context.Background()
	s.SetLoggerV2(l, l.log.Enabled(ctx, slog.LevelDebug), l.log.Enabled(ctx, LevelTrace), false)
}

func (l *serverLogger) Noticef(format string, v ...any) { l.logf(slog.LevelInfo, format, v) }
func (l *serverLogger) Warnf(format string, v ...any)   { l.logf(slog.LevelWarn, format, v) }
func (l *serverLogger) Errorf(format string, v ...any)  { l.logf(slog.LevelError, format, v) }
func (l *serverLogger) Debugf(format string, v ...any)  { l.logf(slog.LevelDebug, format, v) }
func (l *serverLogger) Tracef(format string, v ...any)  { l.logf(LevelTrace, format, v) }

func (l *serverLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	l.log.Error(msg, "fatal", true)
	err := &serverError{msg: msg}
	for _, a := range v {
		if cause, ok := a.(error); ok {
			err.cause = cause
			break
		}
	}
	select {
	case l.fatal <- err:
	default:
	}
}

func (l *serverLogger) logf(level slog.Level, format string, v []any) {
	ctx := context.Background()
	if !l.log.Enabled(ctx, level) {
		return
	}
	l.log.Log(ctx, level, fmt.Sprintf(format, v...))
}

// serverError is a fatal error of nats-server: its message, wrapping the
// error among its arguments so errors.Is can look at the cause.
type serverError struct {
	msg   string
	cause error
}

func (e *serverError) Error() string { return e.msg }
func (e *serverError) Unwrap() error { return e.cause }
