package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestContractSectionsCited: every section of the contract the docs cite
// ("§16", "contract §7b", "the contract's section 16") has its heading in
// docs/contract.md ("## 16. …"), so that a reader who follows the
// reference finds it.
func TestContractSectionsCited(t *testing.T) {
	t.Parallel()
	contract, err := os.ReadFile("../../docs/contract.md")
	if err != nil {
		t.Fatal(err)
	}
	headings := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^## ([0-9]+[a-z]?)\. `).FindAllStringSubmatch(string(contract), -1) {
		headings[m[1]] = true
	}
	docs, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	cite := regexp.MustCompile(`§ ?([0-9]+[a-z]?)|contract(?:'s)? sections? ([0-9]+[a-z]?)`)
	cited := 0
	for _, path := range append(docs, "../../README.md") {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, m := range cite.FindAllStringSubmatch(line, -1) {
				n := m[1] + m[2]
				cited++
				if !headings[n] {
					t.Errorf("%s:%d cites section %s, docs/contract.md has no heading \"## %s. …\"", filepath.Base(path), i+1, n, n)
				}
			}
		}
	}
	if cited == 0 {
		t.Fatal("no citation found: the pattern is wrong")
	}
}
