package redact

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

func TestURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"", ""},
		{"nats://user:s3cr3t@host:4222", "nats://user:<redacted>@host:4222"},
		{"nats://user:s3cr3t@host:42x22", "nats://user:<redacted>@host:42x22"},
		{"nats://t0ken@host:4222", "nats://<redacted>@host:4222"},
		{"user:s3cr3t@host:4222", "user:<redacted>@host:4222"},
		{"t0ken@host", "<redacted>@host"},
		{"http://u:s3cr3t@engine:8000/metrics", "http://u:<redacted>@engine:8000/metrics"},
		{"http://u:pa@ss/wo?rd@engine:8000", "http://u:<redacted>@engine:8000"},
		{"http://u:p%zzw@host", "http://u:<redacted>@host"},
		{"u:p@w@host/x://y", "u:<redacted>@host/x://y"},
		{"http://host/path", "http://host/path"},
		{"tls://tok@h:4222", "tls://<redacted>@h:4222"},
		{"nats://u:p%40ss@h:1", "nats://u:<redacted>@h:1"},
		{"nats://[::1]:4222", "nats://[::1]:4222"},
		{"nats://x:y@[::1]:4222", "nats://x:<redacted>@[::1]:4222"},
		{"::not a url@h", "<redacted>@h"},
		{"nats://:pw@h", "nats://<redacted>@h"},
		{"nats://REDACTED:pw@host:1", "nats://REDACTED:<redacted>@host:1"},
	} {
		if got := URL(tc.in); got != tc.want {
			t.Errorf("URL(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestURLs(t *testing.T) {
	t.Parallel()
	in := "nats://a:pw1@h1:4222, nats://h2:4222,tok2@h3:4222"
	want := "nats://a:<redacted>@h1:4222, nats://h2:4222,<redacted>@h3:4222"
	if got := URLs(in); got != want {
		t.Errorf("URLs(%q) = %q, want %q", in, got, want)
	}
}

// TestParse: url.Parse's error quotes the raw URL, password and all; Parse's
// names it redacted, and keeps the reason and the *url.Error type.
func TestParse(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ raw, secret, want string }{
		{"nats://user:s3cr3t@host:42x22", "s3cr3t", `parse "nats://user:<redacted>@host:42x22": invalid port ":42x22" after host`},
		{"http://u:s3%zzcr3t@host", "s3%zzcr3t", `parse "http://u:<redacted>@host": invalid URL escape "<redacted>"`},
		{"http://t0k3n@ho st", "t0k3n", `parse "http://<redacted>@ho st": invalid character " " in host name`},
		{"http://u:s3cr3t@host\x7f", "s3cr3t", `parse "http://u:<redacted>@host\x7f": net/url: invalid control character in URL`},
	} {
		if _, err := url.Parse(tc.raw); err == nil || !strings.Contains(err.Error(), tc.secret) {
			t.Fatalf("url.Parse(%q) = %v: the case no longer shows the leak", tc.raw, err)
		}
		_, err := Parse(tc.raw)
		if err == nil {
			t.Fatalf("Parse(%q): no error", tc.raw)
		}
		if err.Error() != tc.want {
			t.Errorf("Parse(%q) = %q, want %q", tc.raw, err, tc.want)
		}
		var ue *url.Error
		if !errors.As(err, &ue) || strings.Contains(ue.URL, tc.secret) {
			t.Errorf("Parse(%q): %#v is not a *url.Error without the secret", tc.raw, err)
		}
	}
	if u, err := Parse("http://u:p@host:80/x"); err != nil || u.User.Username() != "u" {
		t.Errorf("Parse of a valid URL = %v, %v", u, err)
	}
}

// TestError: net/http hides a password as *** but shows a token given as
// the user; Error hides both, and keeps the chain.
func TestError(t *testing.T) {
	t.Parallel()
	sentinel := errors.New("unreachable")
	for _, raw := range []string{"http://t0k3n@127.0.0.1:1", "http://u:s3cr3t@127.0.0.1:1"} {
		req, err := http.NewRequest(http.MethodGet, raw+"/x", nil)
		if err != nil {
			t.Fatal(err)
		}
		_, herr := (&http.Client{Transport: failing{}}).Do(req)
		err = Error(fmt.Errorf("%w at %s: %w", sentinel, raw, herr), raw)
		for _, secret := range []string{"t0k3n", "s3cr3t"} {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("Error: %q shows %s", err, secret)
			}
		}
		if !errors.Is(err, sentinel) || !errors.Is(err, errFailing) {
			t.Errorf("Error(%v) lost the chain", err)
		}
		if !strings.Contains(err.Error(), Mark+"@127.0.0.1:1") {
			t.Errorf("Error: %q does not say where", err)
		}
	}
	plain := errors.New(`dial "host:1": refused`)
	if got := Error(plain, "nats://host:1"); got != plain {
		t.Errorf("Error without a secret = %v, want the error itself", got)
	}
	if Error(nil) != nil {
		t.Error("Error(nil) is not nil")
	}
}

var errFailing = errors.New("connection refused")

type failing struct{}

func (failing) RoundTrip(*http.Request) (*http.Response, error) { return nil, errFailing }

func TestValue(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"nats-password", "s3cr3t", Mark},
		{"admin-token", "t0k3n", Mark},
		{"NATS_TOKEN", "t0k3n", Mark},
		{"admin-token", "", ""},
		{"active-prefill-tokens-threshold", "100", "100"},
		{"nats-url", "nats://u:s3cr3t@h:4222,h2:4222", "nats://u:<redacted>@h:4222,h2:4222"},
		{"target", "http://t0k3n@router:8080", "http://<redacted>@router:8080"},
		{"nats-creds", "/etc/nats/user.creds", "/etc/nats/user.creds"},
		{"nats-url", "u:s3cr3t@h:4222", "u:<redacted>@h:4222"},
		{"kill", "2@30s", "2@30s"},
	} {
		if got := Value(tc.name, tc.in); got != tc.want {
			t.Errorf("Value(%q, %q) = %q, want %q", tc.name, tc.in, got, tc.want)
		}
	}
}

// FuzzParse: whatever the password, neither URL nor Parse's error shows it.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"s3cr3t", "pa@ss", "p%zz", "a/b?c#d", "x:y", "", "\"q\""} {
		f.Add(s, "host:42x22")
		f.Add(s, "host:4222")
	}
	f.Fuzz(func(t *testing.T, pw, host string) {
		if strings.Contains(host, "@") {
			return
		}
		secret := "S3CR" + pw
		raws := []string{"nats://user:" + secret + "@" + host, "user:" + secret + "@" + host}
		if !strings.Contains(pw, ":") { // else the part before the : is a user name
			raws = append(raws, secret+"@"+host, "http://"+secret+"@"+host)
		}
		for _, raw := range raws {
			if got := URL(raw); strings.Contains(got, secret) {
				t.Fatalf("URL(%q) = %q", raw, got)
			}
			if _, err := Parse(raw); err != nil && strings.Contains(err.Error(), secret) {
				t.Fatalf("Parse(%q): %v", raw, err)
			}
		}
	})
}
