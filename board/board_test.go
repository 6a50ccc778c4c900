package board

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
)

// TestPages checks what the page and its assets are served with.
func TestPages(t *testing.T) {
	t.Parallel()
	b, _ := testBoard(t, &fakeSource{version: 4}, nil)
	for _, tc := range []struct {
		method, path string
		status       int
		ctype        string
		body         string
	}{
		{"GET", "/", 200, "text/html; charset=utf-8", `src="board/board.js"`},
		{"HEAD", "/", 200, "text/html; charset=utf-8", ""},
		{"GET", "/board/board.js", 200, "text/javascript; charset=utf-8", "EventSource('board/events')"},
		{"GET", "/board/board.css", 200, "text/css; charset=utf-8", ".tile"},
		{"GET", "/board/snapshot", 200, "application/json", `"name":"v4"`},
		{"GET", "/board/index.html", 404, "application/json", `"error"`},
		{"GET", "/board/nothing.js", 404, "application/json", `"error"`},
		{"GET", "/board/a/b.js", 404, "application/json", `"error"`},
		{"GET", "/elsewhere", 404, "application/json", `"error"`},
		{"POST", "/", 405, "application/json", `"error"`},
	} {
		t.Run(tc.method+" "+tc.path, func(t *testing.T) {
			t.Parallel()
			rec := httptest.NewRecorder()
			b.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), tc.method, tc.path, nil))
			if rec.Code != tc.status || rec.Header().Get("Content-Type") != tc.ctype {
				t.Fatalf("%d %q, want %d %q", rec.Code, rec.Header().Get("Content-Type"), tc.status, tc.ctype)
			}
			if !strings.Contains(rec.Body.String(), tc.body) {
				t.Fatalf("body %.200q does not hold %q", rec.Body.String(), tc.body)
			}
			if csp := rec.Header().Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'self'") {
				t.Fatalf("Content-Security-Policy %q", csp)
			}
			if tc.status >= 400 && !json.Valid(rec.Body.Bytes()) {
				t.Fatalf("error body is not JSON: %q", rec.Body.String())
			}
		})
	}
}

// TestAssetsSelfContained: the page loads nothing from elsewhere (it works
// offline, and the Content-Security-Policy would block it anyway), and
// holds no inline script or style, which the policy forbids.
func TestAssetsSelfContained(t *testing.T) {
	const svgNamespace = "http://www.w3.org/2000/svg"
	t.Parallel()
	external := regexp.MustCompile(`(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}`)
	inline := regexp.MustCompile(`(?i)<script>|<style|\sstyle=|\son[a-z]+=`)
	err := fs.WalkDir(assets, ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := fs.ReadFile(assets, name)
		if err != nil {
			return err
		}
		// The SVG namespace is a name, not a place: createElementNS needs
		// it, and nothing is loaded from it.
		if m := external.Find(bytes.ReplaceAll(data, []byte(svgNamespace), nil)); m != nil {
			t.Errorf("%s refers to %q", name, m)
		}
		if strings.HasSuffix(name, ".html") {
			if m := inline.Find(data); m != nil {
				t.Errorf("%s has inline %q", name, m)
			}
		}
		if _, ok := contentTypes[name[strings.LastIndex(name, "."):]]; !ok {
			t.Errorf("%s has no content type", name)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestPatternsMount: mounted on another mux with Patterns, the board
// serves its paths and leaves every other path to the mux's other
// handlers.
func TestPatternsMount(t *testing.T) {
	t.Parallel()
	b, _ := testBoard(t, &fakeSource{}, nil)
	mux := http.NewServeMux()
	for _, p := range Patterns {
		mux.Handle(p, b)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) })
	for path, want := range map[string]int{"/": 200, "/board/board.js": 200, "/busy": http.StatusTeapot, "/x/": http.StatusTeapot} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, path, nil))
		if rec.Code != want {
			t.Errorf("GET %s: %d, want %d", path, rec.Code, want)
		}
	}
}
