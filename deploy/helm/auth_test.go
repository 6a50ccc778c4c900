package helm

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

const full = releaseName + "-workermon"

// roles are the users of our own NATS, and the keys of their passwords.
var roles = []string{"monitor", "router", "engine"}

// passwordEnv is the variable the NATS server reads a role's password from.
func passwordEnv(role string) string { return "WORKERMON_NATS_" + strings.ToUpper(role) + "_PASSWORD" }

// parseUsers parses a NATS configuration with nats-server's own parser,
// the passwords given in the environment, and returns its users by name.
func parseUsers(t *testing.T, conf string, passwords map[string]string) map[string]*server.User {
	t.Helper()
	t.Setenv("SERVER_NAME", full+"-nats-0")
	for _, role := range roles {
		t.Setenv(passwordEnv(role), passwords[role])
	}
	path := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("nats-server rejects the configuration: %v\n%s", err, conf)
	}
	if opts.Username != "" || opts.Authorization != "" || len(opts.Nkeys) > 0 {
		t.Errorf("a single user %q, a token or nkeys besides the users", opts.Username)
	}
	users := map[string]*server.User{}
	for _, u := range opts.Users {
		users[u.Username] = u
	}
	return users
}

// natsConf returns the rendered nats.conf.
func (r rendered) natsConf(t *testing.T) string {
	t.Helper()
	cm, _ := r.find("ConfigMap", full+"-nats-config").(*corev1.ConfigMap)
	if cm == nil {
		t.Fatal("no NATS ConfigMap")
	}
	return cm.Data["nats.conf"]
}

// passwords returns the passwords of the chart's generated Secret.
func (r rendered) passwords(t *testing.T) map[string]string {
	t.Helper()
	s, _ := r.find("Secret", full+"-nats-auth").(*corev1.Secret)
	if s == nil {
		t.Fatal("no Secret " + full + "-nats-auth")
	}
	out := map[string]string{}
	for _, role := range roles {
		out[role] = string(s.Data[role+"-password"])
	}
	if len(s.Data) != len(roles) {
		t.Errorf("Secret keys %v, want one password per role", slices.Collect(mapKeys(s.Data)))
	}
	return out
}

func mapKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// mayPublish reports whether u's permissions let it publish subject.
func mayPublish(u *server.User, subject string) bool {
	return allows(u.Permissions.Publish, subject)
}

func maySubscribe(u *server.User, subject string) bool {
	return allows(u.Permissions.Subscribe, subject)
}

func allows(p *server.SubjectPermission, subject string) bool {
	if p == nil {
		return true
	}
	for _, d := range p.Deny {
		if server.SubjectMatchesFilter(subject, d) {
			return false
		}
	}
	return slices.ContainsFunc(p.Allow, func(f string) bool { return server.SubjectMatchesFilter(subject, f) })
}

// envOf returns a container's variable, or nil.
func envOf(c corev1.Container, name string) *corev1.EnvVar {
	for i := range c.Env {
		if c.Env[i].Name == name {
			return &c.Env[i]
		}
	}
	return nil
}

// secretRef reports whether env is a secretKeyRef to name/key.
func secretRef(env *corev1.EnvVar, name, key string) bool {
	return env != nil && env.ValueFrom != nil && env.ValueFrom.SecretKeyRef != nil &&
		env.ValueFrom.SecretKeyRef.Name == name && env.ValueFrom.SecretKeyRef.Key == key
}

// deployment returns the container of a component's Deployment.
func (r rendered) container(t *testing.T, component string) corev1.Container {
	t.Helper()
	d, _ := r.find("Deployment", full+"-"+component).(*appsv1.Deployment)
	if d == nil {
		t.Fatalf("no %s Deployment", component)
	}
	return d.Spec.Template.Spec.Containers[0]
}

// TestNATSAuthDefaults: by default our own NATS has one user per role,
// with the permission split of docs/deployment.md (routers may publish
// their queues, the rq subjects of contract §22, engines may not...), the
// passwords in a Secret the chart generates, passed to the NATS server and
// to each workermon container through secretKeyRefs and never in clear in
// a ConfigMap or on a command line.
func TestNATSAuthDefaults(t *testing.T) {
	r, err := render(t, chartDir, map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	pw := r.passwords(t)
	alnum := regexp.MustCompile(`^[A-Za-z0-9]{32}$`)
	for role, p := range pw {
		if !alnum.MatchString(p) {
			t.Errorf("%s's password %q: want 32 random letters and digits", role, p)
		}
	}
	if pw["monitor"] == pw["router"] || pw["router"] == pw["engine"] || pw["monitor"] == pw["engine"] {
		t.Error("two roles share a password")
	}
	users := parseUsers(t, r.natsConf(t), pw)
	if len(users) != len(roles) {
		t.Fatalf("users %v, want %v", slices.Collect(mapKeys(users)), roles)
	}
	for _, role := range roles {
		if u := users[role]; u == nil || u.Password != pw[role] || u.Permissions == nil {
			t.Fatalf("user %s: %+v, want the Secret's password and permissions", role, u)
		}
	}
	const m = "Qwen/Qwen3-0=2E6B"
	for _, c := range []struct {
		user, subject string
		publish, want bool
	}{
		// The routers' queues (§22): routers publish them, plain and mapped;
		// engines and monitors may not; monitors hear them.
		{"router", "workermon.rq." + m, true, true},
		{"router", "workermon.part.3.rq." + m, true, true},
		{"engine", "workermon.rq." + m, true, false},
		{"engine", "workermon.part.3.rq." + m, true, false},
		{"monitor", "workermon.rq." + m, true, false},
		{"monitor", "workermon.part.3.rq." + m, false, true},
		// An engine's own subjects, which a router may not publish.
		{"engine", "workermon.load." + m + ".7.0", true, true},
		{"engine", "workermon.part.3.load." + m + ".7.0", true, true},
		{"engine", "workermon.bye." + m + ".7", true, true},
		{"engine", "workermon.lat." + m + ".7", true, true},
		{"router", "workermon.load." + m + ".7.0", true, false},
		{"router", "workermon.bye." + m + ".7", true, false},
		{"router", "workermon.lat." + m + ".7", true, false},
		// A router's estimates and latency windows, which an engine may not.
		{"router", "workermon.est." + m + ".7.0", true, true},
		{"router", "workermon.latr." + m + ".7", true, true},
		{"engine", "workermon.est." + m + ".7.0", true, false},
		{"engine", "workermon.latr." + m + ".7", true, false},
		// The records: only monitors write them; an engine writes only the
		// registry.
		{"monitor", "$KV.workermon-busy." + m, true, true},
		{"router", "$KV.workermon-busy." + m, true, false},
		{"engine", "$KV.workermon-busy." + m, true, false},
		{"engine", "$KV.workermon-thresholds." + m, true, false},
		{"engine", "$KV.workermon-workers." + m + ".7", true, true},
		{"router", "$KV.workermon-workers." + m + ".7", true, false},
		// The rescheduler's requests: monitors send, engines hear.
		{"monitor", "workermon.migrate." + m + ".7", true, true},
		{"engine", "workermon.migrate." + m + ".7", false, true},
		{"engine", "workermon.migrate." + m + ".7", true, false},
		{"router", "workermon.migrate." + m + ".7", true, false},
		// Only monitors hear the reports.
		{"monitor", "workermon.part.3.load." + m + ".7.0", false, true},
		{"router", "workermon.part.3.load." + m + ".7.0", false, false},
		{"engine", "workermon.part.3.load." + m + ".7.0", false, false},
	} {
		verb, may := "subscribe to", maySubscribe(users[c.user], c.subject)
		if c.publish {
			verb, may = "publish", mayPublish(users[c.user], c.subject)
		}
		if may != c.want {
			t.Errorf("%s may %s %s: %v, want %v", c.user, verb, c.subject, may, c.want)
		}
	}
	if users["engine"].Permissions.Response == nil {
		t.Error("engines may not answer the migrate requests (allow_responses)")
	}

	// The credentials reach the containers through secretKeyRefs only.
	secret := full + "-nats-auth"
	for _, role := range []string{"monitor", "router"} {
		c := r.container(t, role)
		if u := envOf(c, "WORKERMON_NATS_USER"); u == nil || u.Value != role {
			t.Errorf("%s: WORKERMON_NATS_USER %+v, want %s", role, u, role)
		}
		if p := envOf(c, "WORKERMON_NATS_PASSWORD"); !secretRef(p, secret, role+"-password") {
			t.Errorf("%s: WORKERMON_NATS_PASSWORD %+v, want a secretKeyRef to %s/%s-password", role, p, secret, role)
		}
	}
	sts, _ := r.find("StatefulSet", full+"-nats").(*appsv1.StatefulSet)
	if sts == nil {
		t.Fatal("no NATS StatefulSet")
	}
	for _, role := range roles {
		if p := envOf(sts.Spec.Template.Spec.Containers[0], passwordEnv(role)); !secretRef(p, secret, role+"-password") {
			t.Errorf("NATS: %s %+v, want a secretKeyRef to %s/%s-password", passwordEnv(role), p, secret, role)
		}
	}
	for _, o := range r.objects {
		if o.kind == "Secret" {
			continue
		}
		j, err := json.Marshal(o.value)
		if err != nil {
			t.Fatal(err)
		}
		for role, p := range pw {
			if strings.Contains(string(j), p) {
				t.Errorf("%s %s shows %s's password in clear", o.kind, o.name, role)
			}
		}
	}
	if errs := checkContainers(t, r); len(errs) > 0 {
		t.Errorf("--check: %v", errs)
	}
}

// TestNATSUsersMatchNATSConfig: the rendered users have exactly the
// permissions `workermon nats-config --users` prints for the same
// partitions and prefix, as nats-server parses both: one source of truth,
// checked.
func TestNATSUsersMatchNATSConfig(t *testing.T) {
	for name, overrides := range map[string]map[string]any{
		"default":       nil,
		"16 partitions": {"partitions": 16},
		"prefix":        {"partitions": 4, "subjectPrefix": "inference.eu"},
		"one partition": {"partitions": 1},
	} {
		t.Run(name, func(t *testing.T) {
			r, err := render(t, chartDir, readValues(t, "", overrides))
			if err != nil {
				t.Fatal(err)
			}
			pw := r.passwords(t)
			got := parseUsers(t, r.natsConf(t), pw)
			out, err := exec.Command(workermonBin, "nats-config", "--users", "--partitions", fmtValue(r.values["partitions"]),
				"--subject-prefix", fmtValue(r.values["subjectPrefix"])).Output()
			if err != nil {
				t.Fatal(err)
			}
			want := parseUsers(t, string(out), pw)
			if len(got) != len(want) || len(want) != len(roles) {
				t.Fatalf("users %v, want those of nats-config %v", slices.Collect(mapKeys(got)), slices.Collect(mapKeys(want)))
			}
			for name, w := range want {
				g := got[name]
				if g == nil {
					t.Errorf("no user %s", name)
					continue
				}
				if g.Password != w.Password {
					t.Errorf("%s: the password comes from elsewhere than %s", name, passwordEnv(name))
				}
				for _, c := range []struct {
					what      string
					got, want *server.SubjectPermission
				}{{"publish", g.Permissions.Publish, w.Permissions.Publish}, {"subscribe", g.Permissions.Subscribe, w.Permissions.Subscribe}} {
					if c.got == nil || c.want == nil {
						t.Errorf("%s: %s permissions %+v, want %+v", name, c.what, c.got, c.want)
						continue
					}
					gl, wl := slices.Sorted(slices.Values(c.got.Allow)), slices.Sorted(slices.Values(c.want.Allow))
					if !slices.Equal(gl, wl) || len(c.got.Deny) > 0 {
						t.Errorf("%s may %s\n  %q (deny %q)\nwant those of nats-config\n  %q", name, c.what, gl, c.got.Deny, wl)
					}
				}
				if (g.Permissions.Response != nil) != (w.Permissions.Response != nil) {
					t.Errorf("%s: allow_responses differs from nats-config's", name)
				}
			}
		})
	}
}

func fmtValue(v any) string {
	b, _ := json.Marshal(v)
	return strings.Trim(string(b), `"`)
}

// TestNATSAuthVariants: auth off, a Secret of the operator's, and an
// external NATS.
func TestNATSAuthVariants(t *testing.T) {
	t.Run("disabled", func(t *testing.T) {
		r, err := render(t, chartDir, readValues(t, "", map[string]any{"nats.auth.enabled": false}))
		if err != nil {
			t.Fatal(err)
		}
		if r.find("Secret", full+"-nats-auth") != nil {
			t.Error("a Secret rendered with auth off")
		}
		if users := parseUsers(t, r.natsConf(t), nil); len(users) > 0 {
			t.Errorf("users %v with auth off", slices.Collect(mapKeys(users)))
		}
		for _, role := range []string{"monitor", "router"} {
			c := r.container(t, role)
			if envOf(c, "WORKERMON_NATS_USER") != nil || envOf(c, "WORKERMON_NATS_PASSWORD") != nil {
				t.Errorf("%s gets NATS credentials with auth off: %+v", role, c.Env)
			}
		}
		sts, _ := r.find("StatefulSet", full+"-nats").(*appsv1.StatefulSet)
		for _, role := range roles {
			if envOf(sts.Spec.Template.Spec.Containers[0], passwordEnv(role)) != nil {
				t.Errorf("NATS reads %s with auth off", passwordEnv(role))
			}
		}
		if errs := checkContainers(t, r); len(errs) > 0 {
			t.Errorf("--check: %v", errs)
		}
	})
	t.Run("existing secret", func(t *testing.T) {
		r, err := render(t, chartDir, readValues(t, "", map[string]any{"nats.auth.existingSecret": "my-nats-users"}))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range r.objects {
			if o.kind == "Secret" {
				t.Errorf("Secret %s rendered beside the existing one", o.name)
			}
		}
		for _, role := range []string{"monitor", "router"} {
			if p := envOf(r.container(t, role), "WORKERMON_NATS_PASSWORD"); !secretRef(p, "my-nats-users", role+"-password") {
				t.Errorf("%s: WORKERMON_NATS_PASSWORD %+v, want my-nats-users/%s-password", role, p, role)
			}
		}
		sts, _ := r.find("StatefulSet", full+"-nats").(*appsv1.StatefulSet)
		for _, role := range roles {
			if p := envOf(sts.Spec.Template.Spec.Containers[0], passwordEnv(role)); !secretRef(p, "my-nats-users", role+"-password") {
				t.Errorf("NATS: %s %+v, want my-nats-users/%s-password", passwordEnv(role), p, role)
			}
		}
		pw := map[string]string{"monitor": "a", "router": "b", "engine": "c"}
		if users := parseUsers(t, r.natsConf(t), pw); len(users) != len(roles) || users["router"] == nil || users["router"].Password != "b" {
			t.Errorf("users %v: want the three roles, their passwords from the environment", users)
		}
	})
	t.Run("external NATS", func(t *testing.T) {
		r, err := render(t, chartDir, readValues(t, filepath.Join("examples", "external-nats.yaml"), nil))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range r.objects {
			if o.kind == "Secret" {
				t.Errorf("Secret %s rendered for an external NATS", o.name)
			}
		}
		if u := envOf(r.container(t, "monitor"), "WORKERMON_NATS_USER"); u != nil {
			t.Errorf("the monitor gets our NATS's user %+v on an external NATS", u)
		}
	})
}

// policyAdmits reports whether np lets a pod of the release's namespace
// with the labels from reach port (a port name) of the pods it selects.
func policyAdmits(t *testing.T, np *networkingv1.NetworkPolicy, from map[string]string, port string) bool {
	t.Helper()
	for _, rule := range np.Spec.Ingress {
		portOK := len(rule.Ports) == 0 || slices.ContainsFunc(rule.Ports, func(p networkingv1.NetworkPolicyPort) bool {
			return p.Port != nil && p.Port.StrVal == port
		})
		if !portOK {
			continue
		}
		if len(rule.From) == 0 {
			return true
		}
		for _, peer := range rule.From {
			if peer.NamespaceSelector != nil || peer.IPBlock != nil || peer.PodSelector == nil {
				continue // another namespace or addresses
			}
			if selects(t, peer.PodSelector, from) {
				return true
			}
		}
	}
	return false
}

func selects(t *testing.T, sel *metav1.LabelSelector, l map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatal(err)
	}
	return s.Matches(labels.Set(l))
}

// podLabels returns the pod template labels and the container port names
// of a workload.
func (r rendered) pod(t *testing.T, kind, name string) (map[string]string, []string) {
	t.Helper()
	var tmpl *corev1.PodTemplateSpec
	switch v := r.find(kind, name).(type) {
	case *appsv1.Deployment:
		tmpl = &v.Spec.Template
	case *appsv1.StatefulSet:
		tmpl = &v.Spec.Template
	default:
		t.Fatalf("no %s %s", kind, name)
	}
	var ports []string
	for _, c := range tmpl.Spec.Containers {
		for _, p := range c.Ports {
			ports = append(ports, p.Name)
		}
	}
	return tmpl.Labels, ports
}

// TestNetworkPolicy: by default only the release's monitors and routers
// and the pods labelled as NATS clients reach NATS's client port, only the
// NATS nodes its cluster port, nobody its monitoring port; the monitors'
// HTTP port only from the pods labelled as their clients.
func TestNetworkPolicy(t *testing.T) {
	r, err := render(t, chartDir, map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	natsNP, _ := r.find("NetworkPolicy", full+"-nats").(*networkingv1.NetworkPolicy)
	monNP, _ := r.find("NetworkPolicy", full+"-monitor").(*networkingv1.NetworkPolicy)
	if natsNP == nil || monNP == nil {
		t.Fatalf("NetworkPolicies: nats %v, monitor %v", natsNP != nil, monNP != nil)
	}
	natsPod, natsPorts := r.pod(t, "StatefulSet", full+"-nats")
	monPod, monPorts := r.pod(t, "Deployment", full+"-monitor")
	routerPod, _ := r.pod(t, "Deployment", full+"-router")
	engine := map[string]string{"app": "vllm", "workermon.io/nats-client": "true"}
	tool := map[string]string{"app": "ops", "workermon.io/monitor-client": "true"}
	stranger := map[string]string{"app": "vllm"}
	for _, c := range []struct {
		np       *networkingv1.NetworkPolicy
		target   map[string]string
		ports    []string
		from     string
		fromPod  map[string]string
		port     string
		admitted bool
	}{
		{natsNP, natsPod, natsPorts, "monitor", monPod, "client", true},
		{natsNP, natsPod, natsPorts, "router", routerPod, "client", true},
		{natsNP, natsPod, natsPorts, "a labelled engine", engine, "client", true},
		{natsNP, natsPod, natsPorts, "an unlabelled pod", stranger, "client", false},
		{natsNP, natsPod, natsPorts, "a monitor client", tool, "client", false},
		{natsNP, natsPod, natsPorts, "a NATS peer", natsPod, "cluster", true},
		{natsNP, natsPod, natsPorts, "monitor", monPod, "cluster", false},
		{natsNP, natsPod, natsPorts, "a labelled engine", engine, "cluster", false},
		{natsNP, natsPod, natsPorts, "a NATS peer", natsPod, "monitor", false},
		{natsNP, natsPod, natsPorts, "monitor", monPod, "monitor", false},
		{monNP, monPod, monPorts, "a monitor client", tool, "http", true},
		{monNP, monPod, monPorts, "router", routerPod, "http", false},
		{monNP, monPod, monPorts, "a labelled engine", engine, "http", false},
		{monNP, monPod, monPorts, "an unlabelled pod", stranger, "http", false},
	} {
		if !selects(t, &c.np.Spec.PodSelector, c.target) {
			t.Errorf("%s selects not the pods it guards (%v)", c.np.Name, c.target)
		}
		if !slices.Contains(c.ports, c.port) {
			t.Errorf("%s: the pods it guards have no port %q (%v)", c.np.Name, c.port, c.ports)
		}
		if got := policyAdmits(t, c.np, c.fromPod, c.port); got != c.admitted {
			t.Errorf("%s: %s reaches port %s: %v, want %v", c.np.Name, c.from, c.port, got, c.admitted)
		}
	}
	if selects(t, &natsNP.Spec.PodSelector, monPod) || selects(t, &monNP.Spec.PodSelector, routerPod) {
		t.Error("a policy selects pods of another component")
	}
	for _, np := range []*networkingv1.NetworkPolicy{natsNP, monNP} {
		if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
			t.Errorf("%s: policy types %v, want Ingress only", np.Name, np.Spec.PolicyTypes)
		}
	}

	t.Run("disabled", func(t *testing.T) {
		r, err := render(t, chartDir, readValues(t, "", map[string]any{"networkPolicy.enabled": false}))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range r.objects {
			if o.kind == "NetworkPolicy" {
				t.Errorf("NetworkPolicy %s rendered while disabled", o.name)
			}
		}
	})
	t.Run("opened", func(t *testing.T) {
		other := map[string]any{"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": "llm"}}}
		r, err := render(t, chartDir, readValues(t, "", map[string]any{
			"networkPolicy.nats.clientPodLabels":    nil, // Helm's null: the key goes
			"networkPolicy.nats.extraFrom":          []any{other},
			"networkPolicy.nats.monitoringFrom":     []any{other},
			"networkPolicy.monitor.clientPodLabels": nil,
			"networkPolicy.monitor.extraFrom":       []any{},
		}))
		if err != nil {
			t.Fatal(err)
		}
		natsNP, _ := r.find("NetworkPolicy", full+"-nats").(*networkingv1.NetworkPolicy)
		monNP, _ := r.find("NetworkPolicy", full+"-monitor").(*networkingv1.NetworkPolicy)
		if natsNP == nil || monNP == nil {
			t.Fatal("a NetworkPolicy is missing")
		}
		// No labels: no empty selector, which would admit every pod.
		if policyAdmits(t, natsNP, stranger, "client") || policyAdmits(t, natsNP, engine, "client") {
			t.Error("with no client labels, any pod reaches NATS")
		}
		if !policyAdmits(t, natsNP, monPod, "client") {
			t.Error("the monitors no longer reach NATS")
		}
		var client, monitoring int
		for _, rule := range natsNP.Spec.Ingress {
			for _, p := range rule.From {
				if p.NamespaceSelector != nil && p.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] == "llm" {
					switch rule.Ports[0].Port.StrVal {
					case "client":
						client++
					case "monitor":
						monitoring++
					}
				}
			}
		}
		if client != 1 || monitoring != 1 {
			t.Errorf("namespace llm admitted to the client port %d times, the monitoring port %d times; want 1 and 1", client, monitoring)
		}
		if len(monNP.Spec.Ingress) != 0 {
			t.Errorf("monitor policy with no clients admits %+v, want nothing", monNP.Spec.Ingress)
		}
	})
	t.Run("external NATS", func(t *testing.T) {
		r, err := render(t, chartDir, readValues(t, filepath.Join("examples", "external-nats.yaml"), nil))
		if err != nil {
			t.Fatal(err)
		}
		if r.find("NetworkPolicy", full+"-nats") != nil || r.find("NetworkPolicy", full+"-monitor") == nil {
			t.Error("with an external NATS: want the monitor's policy only")
		}
	})
}
