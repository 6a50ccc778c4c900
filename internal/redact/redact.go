// Package redact hides credentials in what workermon prints: errors, log
// lines, the configuration `--check` shows (contract §19). A URL's user
// info is found by string means, never by parsing alone, so a URL that does
// not parse is hidden too: url.Parse's own error quotes the raw string,
// password and all.
//
// What counts as a secret: the password of a URL's user info, and the user
// part when it stands alone (a NATS token, an HTTP token given as the user
// name); the value of a flag or field whose last word is password, token or
// secret. A user name beside a password stays, for whoever debugs.
package redact

import (
	"errors"
	"net/url"
	"strconv"
	"strings"
)

// Mark stands for a hidden secret.
const Mark = "<redacted>"

// URL returns raw with the secret of its user info replaced by Mark:
// scheme://user:<redacted>@host, scheme://<redacted>@host for a lone user
// part. Anything before the last @ of the authority counts as user info, so
// a password holding @, / or ? is hidden whole. raw need not parse, and may
// lack the scheme (user:pass@host:4222, as NATS reads it). Without an @, raw
// is returned as is.
func URL(raw string) string {
	start, at := userinfo(raw)
	if at < 0 {
		return raw
	}
	return raw[:start] + hide(raw[start:at]) + raw[at:]
}

// URLs applies URL to each entry of a comma-separated list of URLs.
func URLs(list string) string {
	if !strings.Contains(list, "@") {
		return list
	}
	parts := strings.Split(list, ",")
	for i, p := range parts {
		parts[i] = URL(p)
	}
	return strings.Join(parts, ",")
}

// userinfo returns where the user info of raw starts and where its last @
// is; at is -1 when raw has none.
func userinfo(raw string) (start, at int) {
	if i := strings.Index(raw, "://"); i >= 0 && !strings.Contains(raw[:i], "@") {
		start = i + len("://")
	}
	at = strings.LastIndex(raw[start:], "@")
	if at < 0 {
		return start, -1
	}
	return start, start + at
}

// hide returns the user info info with its secret replaced by Mark.
func hide(info string) string {
	if user, _, ok := strings.Cut(info, ":"); ok && user != "" {
		return user + ":" + Mark
	}
	return Mark
}

// Parse parses raw as url.Parse does. Its error is a *url.Error naming raw
// through URL, with the quoted parts of url.Parse's reason that come from
// the user info (an invalid escape in a password) replaced by Mark.
func Parse(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err == nil {
		return u, nil
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		return nil, &url.Error{Op: ue.Op, URL: URL(raw), Err: errors.New(scrub(ue.Err.Error(), raw))}
	}
	return nil, errors.New(scrub(err.Error(), raw))
}

// Error returns err with its message cleaned of the secrets of the URLs
// raws (comma-separated lists too), and of the user info of every URL it
// quotes: net/http's errors quote the request URL with the password as ***
// but a lone user part (a token) in clear. errors.Is and errors.As still see
// err's chain. A nil err stays nil.
func Error(err error, raws ...string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	clean := msg
	for _, list := range raws {
		for _, raw := range strings.Split(list, ",") {
			clean = scrub(clean, raw)
		}
	}
	clean = scrubQuoted(clean, "")
	if clean == msg {
		return err
	}
	return &cleaned{msg: clean, err: err}
}

// cleaned is an error whose message has had its secrets removed.
type cleaned struct {
	msg string
	err error
}

func (e *cleaned) Error() string { return e.msg }
func (e *cleaned) Unwrap() error { return e.err }

// scrub removes the secret of raw's user info from msg: the user info
// where it follows a scheme, and every quoted part of msg that holds a URL
// with user info or is a piece of raw's.
func scrub(msg, raw string) string {
	start, at := userinfo(strings.TrimSpace(raw))
	if at < 0 {
		return scrubQuoted(msg, "")
	}
	info := strings.TrimSpace(raw)[start:at]
	if info != "" {
		msg = strings.ReplaceAll(msg, "://"+info+"@", "://"+hide(info)+"@")
	}
	return scrubQuoted(msg, info)
}

// scrubQuoted redacts each Go-quoted string of msg that holds a URL with
// user info, or that is a piece of info.
func scrubQuoted(msg, info string) string {
	var b strings.Builder
	for {
		i := strings.IndexByte(msg, '"')
		if i < 0 {
			break
		}
		q, err := strconv.QuotedPrefix(msg[i:])
		if err != nil {
			b.WriteString(msg[:i+1])
			msg = msg[i+1:]
			continue
		}
		b.WriteString(msg[:i])
		msg = msg[i+len(q):]
		s, _ := strconv.Unquote(q)
		switch {
		case s != "" && info != "" && strings.Contains(info, s):
			s = Mark
		case strings.Contains(s, "@"):
			s = URLs(s)
		}
		b.WriteString(strconv.Quote(s))
	}
	b.WriteString(msg)
	return b.String()
}

// Secret reports whether a flag or field named name holds a secret itself:
// its last word (after - or _) is password, token or secret
// (--nats-password, --admin-token; not --active-prefill-tokens-threshold).
// A file that holds one (--nats-creds, --nats-tls-key) is shown as its
// path, never read into a message.
func Secret(name string) bool {
	name = strings.ToLower(name)
	last := name[strings.LastIndexAny(name, "-_")+1:]
	return last == "password" || last == "token" || last == "secret"
}

// Value returns the value of the flag name as it may be shown: Mark for a
// secret flag's non-empty value; the value with the user info of its URLs
// hidden for a flag named for URLs (which may omit the scheme:
// user:pass@host:4222) or a value with a scheme (--target, --endpoint);
// else the value as is (--kill 2@30s is no URL).
func Value(name, value string) string {
	switch {
	case value == "":
		return value
	case Secret(name):
		return Mark
	case strings.Contains(strings.ToLower(name), "url"), strings.Contains(value, "://"):
		return URLs(value)
	}
	return value
}
