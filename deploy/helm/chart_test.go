// Package helm tests the chart at deploy/helm/workermon without a cluster
// (contract §19): it lints and renders the chart with Helm's Go SDK, decodes
// every rendered object strictly into its Kubernetes API type, runs every
// workermon container's command line with --check, and compares the NATS
// configuration with what `workermon nats-config` prints. It is a module of
// its own so that the main module does not depend on Helm.
package helm

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/yaml"
)

const (
	chartDir    = "workermon"
	releaseName = "wm"
	namespace   = "inference"
)

// workermonBin is the workermon binary TestMain builds from this checkout.
var workermonBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "workermon-helm-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	workermonBin = filepath.Join(dir, "workermon")
	goCmd := os.Getenv("GO") // make helm-test passes its $(GO)
	if goCmd == "" {
		goCmd = "go"
	}
	build := exec.Command(goCmd, "build", "-o", workermonBin, "./cmd/workermon")
	build.Dir = filepath.Join("..", "..")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building workermon:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// valuesEnv names more values files to test, comma-separated (`make
// helm-test VALUES=...`): an operator's own, checked like the examples.
const valuesEnv = "WORKERMON_HELM_VALUES"

// valueSets are the default values, each documented example and the files
// of valuesEnv.
func valueSets(t *testing.T) map[string]string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("examples", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no example values in examples/: %v", err)
	}
	sets := map[string]string{"default": ""}
	for _, f := range files {
		sets[strings.TrimSuffix(filepath.Base(f), ".yaml")] = f
	}
	for _, f := range strings.Split(os.Getenv(valuesEnv), ",") {
		if f = strings.TrimSpace(f); f != "" {
			if _, err := os.Stat(f); err != nil {
				t.Fatalf("%s: %v", valuesEnv, err)
			}
			sets[f] = f
		}
	}
	return sets
}

// readValues reads a values file ("" for none) and sets the overrides,
// given as dotted paths.
func readValues(t *testing.T, file string, overrides map[string]any) map[string]any {
	t.Helper()
	vals := map[string]any{}
	if file != "" {
		v, err := chartutil.ReadValuesFile(file)
		if err != nil {
			t.Fatal(err)
		}
		vals = v
	}
	for path, v := range overrides {
		m := vals
		keys := strings.Split(path, ".")
		for _, k := range keys[:len(keys)-1] {
			next, ok := m[k].(map[string]any)
			if !ok {
				next = map[string]any{}
				m[k] = next
			}
			m = next
		}
		m[keys[len(keys)-1]] = v
	}
	return vals
}

// rendered is a chart rendered with one set of values.
type rendered struct {
	values  chartutil.Values // the chart's defaults coalesced with the given ones
	objects []object
}

// object is one rendered Kubernetes object, decoded.
type object struct {
	source, kind, name string
	value              any // *appsv1.Deployment, *corev1.Service, ...
}

// render renders the chart in dir with vals as `helm install --dry-run`
// would, without a cluster, and decodes every object strictly.
func render(t *testing.T, dir string, vals map[string]any) (rendered, error) {
	t.Helper()
	return renderAs(t, dir, releaseName, vals)
}

// renderAs is render under another release name.
func renderAs(t *testing.T, dir, release string, vals map[string]any) (rendered, error) {
	t.Helper()
	ch, err := loader.Load(dir)
	if err != nil {
		return rendered{}, err
	}
	inst := action.NewInstall(&action.Configuration{})
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = release, namespace
	rel, err := inst.Run(ch, vals)
	if err != nil {
		return rendered{}, fmt.Errorf("render: %w", err)
	}
	coalesced, err := chartutil.CoalesceValues(ch, vals)
	if err != nil {
		return rendered{}, err
	}
	r := rendered{values: coalesced}
	manifests := releaseutil.SplitManifests(rel.Manifest)
	keys := make([]string, 0, len(manifests))
	for k := range manifests {
		keys = append(keys, k)
	}
	sort.Sort(releaseutil.BySplitManifestsOrder(keys))
	var errs []error
	for _, k := range keys {
		o, err := decodeStrict(manifests[k])
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w\n%s", k, err, manifests[k]))
			continue
		}
		r.objects = append(r.objects, o)
	}
	return r, errors.Join(errs...)
}

// serviceMonitor is the part of monitoring.coreos.com/v1 ServiceMonitor the
// chart uses (k8s.io/api lacks it).
type serviceMonitor struct {
	APIVersion string             `json:"apiVersion"`
	Kind       string             `json:"kind"`
	Metadata   metav1ObjectMeta   `json:"metadata"`
	Spec       serviceMonitorSpec `json:"spec"`
}

type metav1ObjectMeta struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels,omitempty"`
}

type serviceMonitorSpec struct {
	Selector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"selector"`
	Endpoints []struct {
		Port     string `json:"port"`
		Path     string `json:"path"`
		Interval string `json:"interval,omitempty"`
	} `json:"endpoints"`
}

// scaledObject is the part of keda.sh/v1alpha1 ScaledObject the chart uses.
type scaledObject struct {
	APIVersion string           `json:"apiVersion"`
	Kind       string           `json:"kind"`
	Metadata   metav1ObjectMeta `json:"metadata"`
	Spec       struct {
		ScaleTargetRef struct {
			Kind string `json:"kind"`
			Name string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicaCount int `json:"minReplicaCount"`
		MaxReplicaCount int `json:"maxReplicaCount"`
		PollingInterval int `json:"pollingInterval"`
		CooldownPeriod  int `json:"cooldownPeriod"`
		Triggers        []struct {
			Type       string            `json:"type"`
			MetricType string            `json:"metricType,omitempty"`
			Metadata   map[string]string `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

// decodeStrict decodes one manifest into its type: an unknown field, a
// duplicate key or a wrong type is an error, as is a kind the chart is not
// expected to render.
func decodeStrict(manifest string) (object, error) {
	j, err := yaml.YAMLToJSONStrict([]byte(manifest))
	if err != nil {
		return object{}, err
	}
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(j, &head); err != nil {
		return object{}, err
	}
	var v any
	switch head.APIVersion + " " + head.Kind {
	case "apps/v1 Deployment":
		v = &appsv1.Deployment{}
	case "apps/v1 StatefulSet":
		v = &appsv1.StatefulSet{}
	case "v1 Service":
		v = &corev1.Service{}
	case "v1 ConfigMap":
		v = &corev1.ConfigMap{}
	case "v1 Secret":
		v = &corev1.Secret{}
	case "networking.k8s.io/v1 NetworkPolicy":
		v = &networkingv1.NetworkPolicy{}
	case "policy/v1 PodDisruptionBudget":
		v = &policyv1.PodDisruptionBudget{}
	case "monitoring.coreos.com/v1 ServiceMonitor":
		v = &serviceMonitor{}
	case "keda.sh/v1alpha1 ScaledObject":
		v = &scaledObject{}
	default:
		return object{}, fmt.Errorf("unexpected object %s %s", head.APIVersion, head.Kind)
	}
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return object{}, fmt.Errorf("%s %s: %w", head.Kind, head.Metadata.Name, err)
	}
	return object{kind: head.Kind, name: head.Metadata.Name, value: v}, nil
}

func (r rendered) find(kind, name string) any {
	for _, o := range r.objects {
		if o.kind == kind && o.name == name {
			return o.value
		}
	}
	return nil
}

// podSpecs returns the pod templates of the Deployments and StatefulSets.
func (r rendered) podSpecs() map[string]*corev1.PodSpec {
	out := map[string]*corev1.PodSpec{}
	for _, o := range r.objects {
		switch v := o.value.(type) {
		case *appsv1.Deployment:
			out[o.kind+"/"+o.name] = &v.Spec.Template.Spec
		case *appsv1.StatefulSet:
			out[o.kind+"/"+o.name] = &v.Spec.Template.Spec
		}
	}
	return out
}

// workermonImage is the image of the workermon containers.
func (r rendered) workermonImage(t *testing.T) string {
	t.Helper()
	img, err := r.values.Table("image")
	if err != nil {
		t.Fatal(err)
	}
	tag, _ := img["tag"].(string)
	if tag == "" {
		tag = "dev" // Chart.yaml's appVersion
	}
	return fmt.Sprintf("%s:%s", img["repository"], tag)
}

// TestLint lints the chart with each set of values, warnings included.
func TestLint(t *testing.T) {
	for name, file := range valueSets(t) {
		t.Run(name, func(t *testing.T) {
			l := lint.All(chartDir, readValues(t, file, nil), namespace, false)
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("lint: %s", m)
				}
			}
		})
	}
}

// TestRender renders the chart with each set of values: every object
// decodes strictly, and every workermon container's command line passes
// `workermon <command> --check`.
func TestRender(t *testing.T) {
	for name, file := range valueSets(t) {
		t.Run(name, func(t *testing.T) {
			r, err := render(t, chartDir, readValues(t, file, nil))
			if err != nil {
				t.Fatal(err)
			}
			if len(r.objects) == 0 {
				t.Fatal("nothing rendered")
			}
			n := 0
			for _, err := range checkContainers(t, r) {
				t.Error(err)
			}
			for _, spec := range r.podSpecs() {
				n += len(spec.Containers)
			}
			if n < 2 {
				t.Errorf("%d containers rendered", n)
			}
			checkHardening(t, r)
		})
	}
}

// TestDefaults checks the layout contract §19 asks for on the defaults.
func TestDefaults(t *testing.T) {
	r, err := render(t, chartDir, map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	full := releaseName + "-workermon"
	mon, _ := r.find("Deployment", full+"-monitor").(*appsv1.Deployment)
	if mon == nil {
		t.Fatal("no monitor Deployment")
	}
	if *mon.Spec.Replicas != 3 {
		t.Errorf("monitors: %d replicas, want 3", *mon.Spec.Replicas)
	}
	c := mon.Spec.Template.Spec.Containers[0]
	if !slices.Contains(c.Args, "--partitions=8") {
		t.Errorf("monitor args %q lack --partitions=8", c.Args)
	}
	if !hasFieldRefEnv(c, "WORKERMON_MONITOR_ID", "metadata.name") {
		t.Errorf("monitor env %v: --monitor-id is not the pod's name", c.Env)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" || c.LivenessProbe == nil || c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("monitor probes: readiness %+v liveness %+v", c.ReadinessProbe, c.LivenessProbe)
	}
	aff := mon.Spec.Template.Spec.Affinity
	if aff == nil || aff.PodAntiAffinity == nil || len(aff.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) == 0 {
		t.Errorf("monitors: no preferred pod anti-affinity: %+v", aff)
	}
	pdb, _ := r.find("PodDisruptionBudget", full+"-monitor").(*policyv1.PodDisruptionBudget)
	if pdb == nil || pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("monitor PodDisruptionBudget %+v, want maxUnavailable 1", pdb)
	}
	rt, _ := r.find("Deployment", full+"-router").(*appsv1.Deployment)
	if rt == nil || *rt.Spec.Replicas != 2 {
		t.Errorf("routers: %+v, want 2 replicas", rt)
	}
	sts, _ := r.find("StatefulSet", full+"-nats").(*appsv1.StatefulSet)
	if sts == nil {
		t.Fatal("no NATS StatefulSet")
	}
	if *sts.Spec.Replicas != 3 || len(sts.Spec.VolumeClaimTemplates) != 1 {
		t.Errorf("NATS: %d replicas, %d claim templates; want 3 and 1", *sts.Spec.Replicas, len(sts.Spec.VolumeClaimTemplates))
	}
	if got := sts.Spec.Template.Spec.Containers[0].Image; got != "workermon-nats:dev" {
		t.Errorf("NATS image %q, want workermon-nats:dev", got)
	}
	for _, kind := range []string{"ServiceMonitor", "ScaledObject"} {
		for _, o := range r.objects {
			if o.kind == kind {
				t.Errorf("%s rendered by default", kind)
			}
		}
	}
}

// checkHardening: every container runs as non-root on a read-only root
// filesystem with resources; a NATS container writes only to its claim.
func checkHardening(t *testing.T, r rendered) {
	t.Helper()
	for name, spec := range r.podSpecs() {
		psc := spec.SecurityContext
		if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
			t.Errorf("%s: pod security context %+v is not non-root", name, psc)
		}
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Errorf("%s: mounts a service account token", name)
		}
		claims := map[string]bool{}
		if strings.HasPrefix(name, "StatefulSet/") {
			sts, _ := r.find("StatefulSet", strings.TrimPrefix(name, "StatefulSet/")).(*appsv1.StatefulSet)
			for _, c := range sts.Spec.VolumeClaimTemplates {
				claims[c.Name] = true
			}
		}
		for _, c := range spec.Containers {
			sc := c.SecurityContext
			if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s/%s: security context %+v: want a read-only root, no privilege escalation", name, c.Name, sc)
			}
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
				t.Errorf("%s/%s: resources %+v: want a CPU request and a memory limit", name, c.Name, c.Resources)
			}
			if c.LivenessProbe == nil || c.ReadinessProbe == nil {
				t.Errorf("%s/%s: no liveness or readiness probe", name, c.Name)
			}
			if len(claims) > 0 {
				for _, m := range c.VolumeMounts {
					if !m.ReadOnly && !claims[m.Name] {
						t.Errorf("%s/%s: %s is writable and not the JetStream claim", name, c.Name, m.MountPath)
					}
				}
			}
		}
	}
}

func hasFieldRefEnv(c corev1.Container, name, path string) bool {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == path {
			return true
		}
	}
	return false
}

// checkContainers runs every workermon container of r with --check, as
// the container would start: its args, its environment (a field reference
// as a pod's value, a secretKeyRef as a placeholder) and the files of its
// Secret volumes as placeholders at their paths. It returns one error per
// container that fails.
func checkContainers(t *testing.T, r rendered) []error {
	t.Helper()
	image := r.workermonImage(t)
	var errs []error
	checked := 0
	for name, spec := range r.podSpecs() {
		for _, c := range spec.Containers {
			if c.Image != image {
				continue
			}
			checked++
			if err := checkContainer(t, name, spec, c); err != nil {
				errs = append(errs, fmt.Errorf("%s/%s: %w", name, c.Name, err))
			}
		}
	}
	if checked == 0 {
		errs = append(errs, fmt.Errorf("no container of image %s", image))
	}
	return errs
}

// fieldRefValues stand for what the downward API gives a container: a
// Deployment's pod name, an address, a StatefulSet pod's index.
var fieldRefValues = map[string]string{
	"metadata.name":      releaseName + "-workermon-monitor-7d9f8b6c5d-x2x7q",
	"metadata.namespace": namespace,
	"status.podIP":       "10.0.0.7",
	"metadata.labels['apps.kubernetes.io/pod-index']": "0",
}

func checkContainer(t *testing.T, name string, spec *corev1.PodSpec, c corev1.Container) error {
	if len(c.Command) > 0 {
		return fmt.Errorf("command %q replaces the image's entrypoint", c.Command)
	}
	if len(c.Args) == 0 {
		return errors.New("no args: no workermon command")
	}
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			v, ok := fieldRefValues[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				return fmt.Errorf("env %s: field %s the test cannot fill", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		case e.ValueFrom.SecretKeyRef != nil:
			env[e.Name] = "placeholder-" + e.ValueFrom.SecretKeyRef.Key
		default:
			return fmt.Errorf("env %s: a source the test cannot fill", e.Name)
		}
	}
	// The Secret volumes' files, as placeholders under a temporary root.
	root := t.TempDir()
	secretMounts := map[string]string{} // mount path -> local directory
	for _, m := range c.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name == m.Name && v.Secret != nil {
				secretMounts[m.MountPath] = filepath.Join(root, m.MountPath)
			}
		}
	}
	args := make([]string, 0, len(c.Args)+1)
	for _, a := range c.Args {
		a = expandK8s(a, env)
		for mount, local := range secretMounts {
			flagName, path, ok := strings.Cut(a, "=")
			if ok && strings.HasPrefix(path, mount+"/") {
				file := filepath.Join(local, strings.TrimPrefix(path, mount+"/"))
				if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
					return err
				}
				if err := os.WriteFile(file, []byte("placeholder\n"), 0o600); err != nil {
					return err
				}
				a = flagName + "=" + file
			}
		}
		args = append(args, a)
	}
	args = append(args, "--check")
	cmd := exec.Command(workermonBin, args...)
	cmd.Env = []string{"HOME=" + root, "TMPDIR=" + root}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		// The reason is the first line; a flag error is followed by the usage.
		reason, _, _ := strings.Cut(strings.TrimSpace(stderr.String()), "\n")
		return fmt.Errorf("workermon %s --check: %v: %s", strings.Join(args[:len(args)-1], " "), err, reason)
	}
	var report struct {
		Command string         `json:"command"`
		Valid   bool           `json:"valid"`
		Flags   map[string]any `json:"flags"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &report); err != nil || !report.Valid || report.Command != c.Args[0] {
		return fmt.Errorf("--check printed %q (%v)", stdout.String(), err)
	}
	// What the Secrets hold never shows.
	for k, v := range env {
		if strings.HasPrefix(v, "placeholder-") && (strings.Contains(k, "PASSWORD") || strings.Contains(k, "TOKEN")) &&
			strings.Contains(stdout.String(), v) {
			return fmt.Errorf("--check shows the secret of %s", k)
		}
	}
	return nil
}

var k8sVar = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expandK8s expands $(VAR) in an argument as the kubelet does.
func expandK8s(s string, env map[string]string) string {
	return k8sVar.ReplaceAllStringFunc(s, func(m string) string {
		if v, ok := env[m[2:len(m)-1]]; ok {
			return v
		}
		return m
	})
}

// TestUnknownFlagFails: the tests catch a template that passes a flag the
// binary does not know, whether from a value or from the template itself.
func TestUnknownFlagFails(t *testing.T) {
	t.Run("value", func(t *testing.T) {
		r, err := render(t, chartDir, readValues(t, "", map[string]any{"router.extraArgs": []any{"--no-such-flag=1"}}))
		if err != nil {
			t.Fatal(err)
		}
		errs := checkContainers(t, r)
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "no-such-flag") {
			t.Fatalf("errors %v, want one naming the router's --no-such-flag", errs)
		}
	})
	t.Run("template", func(t *testing.T) {
		broken := copyChart(t)
		path := filepath.Join(broken, "templates", "monitor.yaml")
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(b, []byte("- --partitions=")) {
			t.Fatal("monitor.yaml passes no --partitions")
		}
		if err := os.WriteFile(path, bytes.Replace(b, []byte("- --partitions="), []byte("- --partition-count="), 1), 0o644); err != nil {
			t.Fatal(err)
		}
		r, err := render(t, broken, map[string]any{})
		if err != nil {
			t.Fatal(err)
		}
		errs := checkContainers(t, r)
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "partition-count") {
			t.Fatalf("errors %v, want one naming the monitor's --partition-count", errs)
		}
	})
	t.Run("invalid value", func(t *testing.T) {
		// The schema lets any string through; the monitor wants [0, 1].
		r, err := render(t, chartDir, readValues(t, "", map[string]any{"monitor.thresholds.activeDecodeBlocks": "1.5"}))
		if err != nil {
			t.Fatal(err)
		}
		errs := checkContainers(t, r)
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "1.5") {
			t.Fatalf("errors %v, want one naming the monitor's threshold 1.5", errs)
		}
	})
}

// copyChart copies the chart to a temporary directory.
func copyChart(t *testing.T) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), chartDir)
	if err := os.CopyFS(dst, os.DirFS(chartDir)); err != nil {
		t.Fatal(err)
	}
	return dst
}

// TestNATSMappings: the rendered nats.conf carries exactly the mappings
// `workermon nats-config` prints for the same partitions and prefix.
func TestNATSMappings(t *testing.T) {
	cases := map[string]map[string]any{
		"default":       nil,
		"16 partitions": {"partitions": 16},
		"prefix":        {"partitions": 4, "subjectPrefix": "inference.eu"},
		"one partition": {"partitions": 1},
	}
	for name, overrides := range cases {
		t.Run(name, func(t *testing.T) {
			r, err := render(t, chartDir, readValues(t, "", overrides))
			if err != nil {
				t.Fatal(err)
			}
			cm, _ := r.find("ConfigMap", releaseName+"-workermon-nats-config").(*corev1.ConfigMap)
			if cm == nil {
				t.Fatal("no NATS ConfigMap")
			}
			conf := cm.Data["nats.conf"]
			parts := fmt.Sprint(r.values["partitions"])
			prefix := fmt.Sprint(r.values["subjectPrefix"])
			out, err := exec.Command(workermonBin, "nats-config", "--partitions", parts, "--subject-prefix", prefix).Output()
			if err != nil {
				t.Fatal(err)
			}
			want, got := mappingLines(string(out)), mappingLines(conf)
			if parts != "1" && len(want) == 0 {
				t.Fatalf("nats-config printed no mappings:\n%s", out)
			}
			if !slices.Equal(got, want) {
				t.Errorf("nats.conf mappings\n%s\nwant those of workermon nats-config --partitions %s\n%s", strings.Join(got, "\n"), parts, strings.Join(want, "\n"))
			}
			if !strings.Contains(conf, "store_dir: /data") {
				t.Errorf("JetStream store is not /data, the claim:\n%s", conf)
			}
			// The monitors and the routers (their estimates and latency
			// windows) on the same prefix as the mappings: the routers
			// had none, and published on workermon.* whatever the prefix.
			for _, comp := range []string{"monitor", "router"} {
				d, _ := r.find("Deployment", releaseName+"-workermon-"+comp).(*appsv1.Deployment)
				if d == nil {
					t.Fatalf("no %s Deployment", comp)
				}
				if args := d.Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, "--subject-prefix="+prefix) {
					t.Errorf("%s args %q lack --subject-prefix=%s", comp, args, prefix)
				}
			}
			if errs := checkContainers(t, r); len(errs) > 0 {
				t.Errorf("--check: %v", errs)
			}
		})
	}
}

// TestPrefillThresholdRefused: a prefill threshold (or a queue-delay
// threshold) that is not a whole number of tokens (milliseconds) is
// refused — by the render for a number, by the monitor's --check for a
// string — as docs/kubernetes.md promises. The chart turned any string
// into int64 0 (busy at the first prefill token, §5), which --check
// accepted.
func TestPrefillThresholdRefused(t *testing.T) {
	for key, flag := range map[string]string{
		"monitor.thresholds.activePrefillTokens": "--active-prefill-tokens-threshold",
		"monitor.thresholds.queueDelayMs":        "--queue-delay-threshold-ms",
	} {
		for _, v := range []any{"1.5", "1e6", "512k", 1.5} {
			t.Run(fmt.Sprint(key, "=", v), func(t *testing.T) {
				r, err := render(t, chartDir, readValues(t, "", map[string]any{key: v}))
				if err != nil {
					return // refused at render
				}
				if errs := checkContainers(t, r); len(errs) > 0 {
					return // refused by --check
				}
				d, _ := r.find("Deployment", releaseName+"-workermon-monitor").(*appsv1.Deployment)
				t.Errorf("%s %q accepted; the monitor runs with %q", key, v, d.Spec.Template.Spec.Containers[0].Args)
			})
		}
		r, err := render(t, chartDir, readValues(t, "", map[string]any{key: 1048576}))
		if err != nil {
			t.Fatal(err)
		}
		d, _ := r.find("Deployment", releaseName+"-workermon-monitor").(*appsv1.Deployment)
		if args := d.Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, flag+"=1048576") {
			t.Errorf("%s: a whole number renders %q", key, args)
		}
	}
}

// mappingLines returns the lines of the first `mappings { ... }` block,
// trimmed.
func mappingLines(conf string) []string {
	var out []string
	in := false
	sc := bufio.NewScanner(strings.NewReader(conf))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "mappings {":
			in = true
		case in && line == "}":
			return out
		case in && line != "":
			out = append(out, line)
		}
	}
	return out
}

// TestNATSConfigParses: nats-server's own parser accepts the rendered
// nats.conf (the mappings' functions included), with JetStream on the claim
// and a route to every node; with the passwords its Secret gives the node,
// it has one user per role.
func TestNATSConfigParses(t *testing.T) {
	t.Setenv("SERVER_NAME", releaseName+"-workermon-nats-0")
	for name, file := range valueSets(t) {
		t.Run(name, func(t *testing.T) {
			r, err := render(t, chartDir, readValues(t, file, nil))
			if err != nil {
				t.Fatal(err)
			}
			cm, _ := r.find("ConfigMap", releaseName+"-workermon-nats-config").(*corev1.ConfigMap)
			sts, _ := r.find("StatefulSet", releaseName+"-workermon-nats").(*appsv1.StatefulSet)
			nats, _ := r.values["nats"].(map[string]any)
			if enabled, _ := nats["enabled"].(bool); !enabled {
				if cm != nil || sts != nil {
					t.Error("NATS rendered while nats.enabled is false")
				}
				return
			}
			if cm == nil || sts == nil {
				t.Fatal("no NATS ConfigMap or StatefulSet")
			}
			// The passwords, as the node's secretKeyRefs give them.
			for _, e := range sts.Spec.Template.Spec.Containers[0].Env {
				if ref := e.ValueFrom; ref != nil && ref.SecretKeyRef != nil {
					v := "placeholder-" + ref.SecretKeyRef.Key
					if secret, _ := r.find("Secret", ref.SecretKeyRef.Name).(*corev1.Secret); secret != nil {
						v = string(secret.Data[ref.SecretKeyRef.Key])
					}
					t.Setenv(e.Name, v)
				}
			}
			path := filepath.Join(t.TempDir(), "nats.conf")
			if err := os.WriteFile(path, []byte(cm.Data["nats.conf"]), 0o644); err != nil {
				t.Fatal(err)
			}
			opts, err := server.ProcessConfigFile(path)
			if err != nil {
				t.Fatalf("nats-server rejects the configuration: %v\n%s", err, cm.Data["nats.conf"])
			}
			replicas := int(*sts.Spec.Replicas)
			if !opts.JetStream || opts.StoreDir != "/data" || opts.ServerName != releaseName+"-workermon-nats-0" {
				t.Errorf("JetStream %v store %q server name %q", opts.JetStream, opts.StoreDir, opts.ServerName)
			}
			if replicas > 1 && len(opts.Routes) != replicas {
				t.Errorf("%d routes for %d nodes", len(opts.Routes), replicas)
			}
			if auth, _ := nats["auth"].(map[string]any); auth["enabled"] == true && len(opts.Users) != 3 {
				t.Errorf("%d NATS users, want one per role (monitor, router, engine)", len(opts.Users))
			}
			mounts := sts.Spec.Template.Spec.Containers[0].VolumeMounts
			if !slices.ContainsFunc(mounts, func(m corev1.VolumeMount) bool { return m.MountPath == opts.StoreDir && m.Name == "data" }) {
				t.Errorf("the store %s is not the claim's mount: %+v", opts.StoreDir, mounts)
			}
		})
	}
}

// TestScrapeSidecarSnippet: the sidecar docs/kubernetes.md gives for engine
// pods decodes strictly into a container and passes `workermon scrape
// --check`.
func TestScrapeSidecarSnippet(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(doc), "<!-- scrape-sidecar -->\n```yaml\n")
	if !ok {
		t.Fatal("docs/kubernetes.md has no scrape-sidecar snippet")
	}
	snippet, _, ok := strings.Cut(after, "```")
	if !ok {
		t.Fatal("the snippet does not end")
	}
	j, err := yaml.YAMLToJSONStrict([]byte(snippet))
	if err != nil {
		t.Fatal(err)
	}
	var containers []corev1.Container
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&containers); err != nil {
		t.Fatalf("the snippet is not a list of containers: %v", err)
	}
	if len(containers) != 1 || len(containers[0].Args) == 0 || containers[0].Args[0] != "scrape" {
		t.Fatalf("want one workermon scrape container, got %+v", containers)
	}
	c := containers[0]
	if err := checkContainer(t, "snippet", &corev1.PodSpec{Containers: containers}, c); err != nil {
		t.Error(err)
	}
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Errorf("the sidecar's security context %+v: want non-root on a read-only root", sc)
	}
}

// TestKEDAExample: the autoscaling example renders a ScaledObject on the
// model's saturation (contract §21), compared as a value below the busy
// line, and gives the monitors the thresholds the saturation is measured
// against (with none, it stays 0 and KEDA never scales out).
func TestKEDAExample(t *testing.T) {
	r, err := render(t, chartDir, readValues(t, filepath.Join("examples", "autoscaling.yaml"), nil))
	if err != nil {
		t.Fatal(err)
	}
	var so *scaledObject
	monitors := 0
	for _, o := range r.objects {
		switch v := o.value.(type) {
		case *scaledObject:
			so = v
		case *serviceMonitor:
			monitors++
		}
	}
	if so == nil || monitors != 2 {
		t.Fatalf("ScaledObject %v, %d ServiceMonitors; want one and two", so, monitors)
	}
	if len(so.Spec.Triggers) != 1 {
		t.Fatalf("triggers %+v", so.Spec.Triggers)
	}
	tr := so.Spec.Triggers[0]
	want := `max(workermon_model_saturation{model="meta-llama/Llama-3.1-8B-Instruct"})`
	if tr.Type != "prometheus" || tr.MetricType != "Value" || tr.Metadata["query"] != want || tr.Metadata["threshold"] != "0.8" {
		t.Errorf("trigger %+v, want prometheus, Value, query %s, threshold 0.8", tr, want)
	}
	if so.Spec.ScaleTargetRef.Name != "vllm-llama" {
		t.Errorf("target %+v", so.Spec.ScaleTargetRef)
	}
	d, _ := r.find("Deployment", releaseName+"-workermon-monitor").(*appsv1.Deployment)
	if d == nil {
		t.Fatal("no monitor Deployment")
	}
	args := d.Spec.Template.Spec.Containers[0].Args
	for _, a := range []string{"--kv-committed-threshold=1.0", "--queue-delay-threshold-ms=1000"} {
		if !slices.Contains(args, a) {
			t.Errorf("the monitor runs with %q, without %s: the saturation has nothing to measure against", args, a)
		}
	}
}

// TestSchema: values.schema.json refuses a mistyped key, a value out of
// range and a word that is not one of the choices, at render and at lint.
func TestSchema(t *testing.T) {
	for name, overrides := range map[string]map[string]any{
		"typo":             {"monitor.replica": 5},
		"typo at the root": {"partition": 8},
		"partitions 0":     {"partitions": 0},
		"anti-affinity":    {"router.antiAffinity": "sometimes"},
		"reject status":    {"router.rejectStatus": 200},
		"bucket replicas":  {"monitor.bucketReplicas": 7},
	} {
		t.Run(name, func(t *testing.T) {
			vals := readValues(t, "", overrides)
			if _, err := render(t, chartDir, vals); err == nil || !strings.Contains(err.Error(), "schema") {
				t.Errorf("render: %v, want the schema's refusal", err)
			}
			l := lint.All(chartDir, vals, namespace, false)
			if l.HighestSeverity < support.ErrorSev {
				t.Errorf("lint passes: %v", l.Messages)
			}
		})
	}
}

// TestLongReleaseName: with the longest release name Helm takes (53
// characters), every Service is a DNS label and the NATS StatefulSet's
// name leaves room for its pods' controller-revision-hash label (the full
// name was cut at 50: a 41-character release made a 64-character Service
// and a NATS cluster that never formed).
func TestLongReleaseName(t *testing.T) {
	r, err := renderAs(t, chartDir, strings.Repeat("r", 53), readValues(t, "", nil))
	if err != nil {
		t.Fatal(err)
	}
	dns := regexp.MustCompile(`^[a-z]([-a-z0-9]*[a-z0-9])?$`)
	for _, o := range r.objects {
		switch {
		case o.kind == "Service" && (len(o.name) > 63 || !dns.MatchString(o.name)):
			t.Errorf("Service %q (%d characters) is not a DNS label", o.name, len(o.name))
		case o.kind == "StatefulSet" && len(o.name) > 52:
			t.Errorf("StatefulSet %q has %d characters: its pods' controller-revision-hash label passes 63", o.name, len(o.name))
		}
	}
}

// TestBucketReplicasFitNATS: buckets of more replicas than the chart's NATS
// nodes could never be created (the monitors and routers would crash-loop):
// the render refuses it.
func TestBucketReplicasFitNATS(t *testing.T) {
	if _, err := render(t, chartDir, readValues(t, "", map[string]any{"nats.replicas": 1})); err == nil || !strings.Contains(err.Error(), "bucketReplicas") {
		t.Errorf("nats.replicas 1 with buckets of 3 replicas: %v, want refused", err)
	}
	if _, err := render(t, chartDir, readValues(t, "", map[string]any{"nats.replicas": 1, "monitor.bucketReplicas": 1, "router.bucketReplicas": 1})); err != nil {
		t.Errorf("one node, one replica: %v", err)
	}
}

// TestNATSRollWaitsForJetStream: a NATS node counts as started only once
// its JetStream is current (the full /healthz), so that a rolling update
// takes the next node down only when the buckets have their copies on this
// one again; it started on js-enabled-only, before catching up.
func TestNATSRollWaitsForJetStream(t *testing.T) {
	r, err := render(t, chartDir, readValues(t, "", nil))
	if err != nil {
		t.Fatal(err)
	}
	ss, _ := r.find("StatefulSet", releaseName+"-workermon-nats").(*appsv1.StatefulSet)
	if ss == nil {
		t.Fatal("no NATS StatefulSet")
	}
	p := ss.Spec.Template.Spec.Containers[0].StartupProbe
	if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" {
		t.Errorf("NATS startup probe %+v: want GET /healthz", p)
	}
}

// TestTLSCertNeedsKey: a client certificate without its key (or a key
// without its certificate) is refused at render; it was dropped without a
// word, and a server that requires mutual TLS then failed the handshake.
func TestTLSCertNeedsKey(t *testing.T) {
	for _, tls := range []map[string]any{{"certKey": "tls.crt"}, {"keyKey": "tls.key"}} {
		vals := map[string]any{"nats.enabled": false, "nats.external.url": "tls://nats.example:4222",
			"nats.external.tls.secretName": "nats-client-tls"}
		for k, v := range tls {
			vals["nats.external.tls."+k] = v
		}
		if _, err := render(t, chartDir, readValues(t, "", vals)); err == nil || !strings.Contains(err.Error(), "certKey and keyKey") {
			t.Errorf("%v: %v, want refused", tls, err)
		}
	}
}
