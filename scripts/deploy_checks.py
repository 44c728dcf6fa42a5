#!/usr/bin/env python3
"""Consistency checks of deploy/ that no schema expresses, run by
scripts/validate-deploy (which validates the schemas themselves).

    deploy_checks.py compose            the compose file against itself, the
                                        Prometheus and Grafana files it mounts,
                                        and docs/configuration.md
    deploy_checks.py k8s [BASE COMBINED]
                                        the kustomizations deploy/k8s and
                                        deploy/k8s/prometheus-operator as
                                        kustomize reads them, the manifests
                                        against each other and
                                        docs/configuration.md, the
                                        PrometheusRule against alerts.yml; and
                                        what kustomize rendered of the base and
                                        of both together, when given
    deploy_checks.py prometheusrule     writes deploy/k8s/prometheus-operator/
                                        prometheusrule.yaml from alerts.yml
    deploy_checks.py grafana RULES_OUT  the dashboard model; writes its PromQL
                                        as a rule file for `promtool check rules`
    deploy_checks.py alerts             every alert has `for`, a severity, a
                                        summary and a description, and is
                                        explained in docs/operations.md

Each prints what it checked and exits 1 with every problem it found.
"""

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROBLEMS = []


def problem(where, message):
    PROBLEMS.append(f"{where}: {message}")


def load_yaml(path):
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def load_yaml_documents(path):
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def documented_variables():
    """Every TASKBROKER_* variable docs/configuration.md (generated from the
    code) lists in its table."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    names = set(re.findall(r"^\| `(TASKBROKER_[A-Z0-9_]+)` \|", text, re.M))
    if not names:
        problem("docs/configuration.md", "no variables found in the table")
    return names


def check_variables(where, names, known):
    for name in names:
        if name.startswith("TASKBROKER_") and name not in known:
            problem(where, f"{name} is not a setting in docs/configuration.md")


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def duration_seconds(text):
    """Compose durations such as `40s`, `1m30s`."""
    total, rest = 0.0, str(text)
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms|us)", rest):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


# --- compose -----------------------------------------------------------------


def check_compose():
    path = DEPLOY / "docker-compose.yml"
    compose = load_yaml(path)
    services = compose.get("services", {})
    volumes = set((compose.get("volumes") or {}).keys())
    known = documented_variables()
    where = "deploy/docker-compose.yml"

    brokers = {}
    for name, service in services.items():
        at = f"{where}: service {name}"
        for dependency, spec in (service.get("depends_on") or {}).items():
            if dependency not in services:
                problem(at, f"depends on unknown service {dependency}")
                continue
            condition = (spec or {}).get("condition", "service_started")
            if condition == "service_healthy" and "healthcheck" not in services[dependency]:
                problem(at, f"waits for {dependency} to be healthy, which has no healthcheck")
        for mount in service.get("volumes") or []:
            source = mount.split(":", 1)[0] if isinstance(mount, str) else mount.get("source", "")
            if source.startswith((".", "/")):
                if not (path.parent / source).exists():
                    problem(at, f"mounts {source}, which does not exist")
            elif source and source not in volumes:
                problem(at, f"uses volume {source}, which is not declared under volumes:")
        build = service.get("build")
        if build:
            context = path.parent / build.get("context", ".")
            if not (context / build.get("dockerfile", "Dockerfile")).is_file():
                problem(at, "build context has no Dockerfile")
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        check_variables(at, environment, known)
        command = service.get("command", ["run"])
        if isinstance(command, str):
            command = command.split()
        if command[:1] == ["run"] and service.get("image", "").startswith("taskbroker"):
            brokers[name] = (service, environment)

    if len(brokers) < 2:
        problem(where, f"expected at least two broker replicas, found {sorted(brokers)}")
    advertised = {}
    for name, (service, environment) in brokers.items():
        at = f"{where}: service {name}"
        for required in ("TASKBROKER_DATABASE_URL", "TASKBROKER_WORKER_ENDPOINTS",
                         "TASKBROKER_GRPC_ADVERTISED_ADDR", "TASKBROKER_KAFKA_CONSUMER_GROUP"):
            if required not in environment:
                problem(at, f"{required} is not set")
        address = environment.get("TASKBROKER_GRPC_ADVERTISED_ADDR", "")
        if address in advertised:
            problem(at, f"advertises {address}, as {advertised[address]} does")
        advertised[address] = name
        if address and address.rsplit(":", 1)[0] not in (name, service.get("hostname")):
            problem(at, f"advertises {address}, which is not this service's name")
        timeout_ms = int(environment.get("TASKBROKER_SHUTDOWN_TIMEOUT_MS", "30000"))
        grace = duration_seconds(service.get("stop_grace_period", "10s"))
        if grace <= timeout_ms / 1000:
            problem(at, f"stop_grace_period {grace}s does not exceed the shutdown timeout {timeout_ms} ms")
    for setting in ("TASKBROKER_DATABASE_URL", "TASKBROKER_KAFKA_CONSUMER_GROUP",
                    "TASKBROKER_GRPC_SHARED_SECRETS", "TASKBROKER_KAFKA_TOPIC"):
        values = {environment.get(setting) for _, environment in brokers.values()}
        if len(values) != 1:
            problem(where, f"the broker replicas disagree on {setting}: {sorted(map(str, values))}")

    # Prometheus scrapes exactly the replicas, on their metrics port, and
    # loads the rule file mounted beside its configuration.
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in prometheus.get("scrape_configs", [])}
    if "taskbroker" not in jobs:
        problem("deploy/prometheus/prometheus.yml", "no scrape job named taskbroker (alerts.yml expects it)")
    else:
        targets = {target for config in jobs["taskbroker"].get("static_configs", [])
                   for target in config.get("targets", [])}
        expected = {f"{name}:{port_of(env.get('TASKBROKER_METRICS_ADDR', '0.0.0.0:9090'))}"
                    for name, (_, env) in brokers.items()}
        if targets != expected:
            problem("deploy/prometheus/prometheus.yml", f"scrapes {sorted(targets)}, the replicas are {sorted(expected)}")
    for rule_file in prometheus.get("rule_files", []):
        mounted = [m for m in services.get("prometheus", {}).get("volumes", [])
                   if isinstance(m, str) and m.split(":")[1] == f"/etc/prometheus/{rule_file}"]
        if not mounted:
            problem(where, f"prometheus loads {rule_file}, which is not mounted into /etc/prometheus")

    # Grafana's dashboard provider reads the directory the dashboard is mounted in.
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "taskbroker.yml")
    provider_paths = {p["options"]["path"] for p in provider.get("providers", [])}
    dashboard_mounts = [m.split(":")[1] for m in services.get("grafana", {}).get("volumes", [])
                        if isinstance(m, str) and m.startswith("./grafana/taskbroker.json")]
    if not dashboard_mounts or str(Path(dashboard_mounts[0]).parent) not in provider_paths:
        problem(where, f"grafana mounts the dashboard at {dashboard_mounts}, the provider reads {sorted(provider_paths)}")
    print(f"compose: {len(services)} services, {len(brokers)} broker replicas, "
          "dependencies, volumes, variables, scrape targets and provisioning paths checked")


# --- Kubernetes --------------------------------------------------------------

K8S = DEPLOY / "k8s"
OPERATOR = K8S / "prometheus-operator"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUSRULE = OPERATOR / "prometheusrule.yaml"
# What this model of a kustomization understands. Anything else (patches,
# namePrefix, generatorOptions, ...) changes what kustomize renders behind
# the checks' back: teach read_kustomization about it first.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "images"}
GENERATOR_FIELDS = {"name", "envs", "options"}
# Files beside a kustomization that it deliberately does not list, and why
# (say, a secret.yaml replaced by your secret store). Every other file must
# be a resource or a generator's input.
UNLISTED = {"kustomization.yaml": "the kustomization itself"}
# Directories under deploy/k8s and what they are. Each is a kustomization
# applied next to the base, checked below; any other directory fails.
ADDONS = {"prometheus-operator": "a ServiceMonitor and a PrometheusRule, for the Prometheus Operator"}
# The job name the alerts expect (TaskbrokerDown selects up{job="taskbroker"}).
SCRAPE_JOB = "taskbroker"


def relative(path):
    return str(Path(path).resolve().relative_to(ROOT))


def read_env_file(path):
    """An env file as kustomize reads it (api/kv): leading whitespace
    dropped, blank lines and `#` comments skipped, the key up to the first
    `=`, the value everything after it, literally."""
    where, data = relative(path), {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        at = f"{where}:{number}"
        if "=" not in line:
            problem(at, "has no `=`: kustomize would take the value from the environment of whoever renders it")
            continue
        key, value = line.split("=", 1)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            problem(at, f"{key!r} is not a variable name")
        if key in data:
            problem(at, f"sets {key} a second time")
        # YAML habits that an env file keeps as part of the value.
        if value != value.strip() or value[:1] in ('"', "'"):
            problem(at, f"{key}: quotes and spaces around the value become part of it: {value!r}")
        data[key] = value
    return data


def read_kustomization(directory):
    """What a kustomization renders, modelled without kustomize: the
    documents of its resource files, the ConfigMaps it generates (under their
    names without the hash) and the directories it lists as resources. Also
    checks that it lists only files that exist and that every file beside it
    is listed or in UNLISTED."""
    where = relative(directory / "kustomization.yaml")
    kustomization = load_yaml(directory / "kustomization.yaml")
    for field in sorted(set(kustomization) - KUSTOMIZATION_FIELDS):
        problem(where, f"uses {field}, which scripts/deploy_checks.py does not model: teach read_kustomization "
                       "about it, or the checks miss what it changes")
    used, documents, bases = set(), [], []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            if not (path / "kustomization.yaml").is_file():
                problem(where, f"lists {entry}, a directory without a kustomization.yaml")
            bases.append(path)
        elif path.is_file() and path.parent == directory.resolve():
            used.add(path.name)
            documents.extend(load_yaml_documents(path))
        elif path.is_file():
            problem(where, f"lists {entry}, outside its directory: list the directory's kustomization instead")
        else:
            problem(where, f"lists {entry}, which does not exist")
    generated = {}
    for generator in kustomization.get("configMapGenerator", []):
        name = generator.get("name")
        at = f"{where}: configMapGenerator {name}"
        for field in sorted(set(generator) - GENERATOR_FIELDS):
            problem(at, f"uses {field}, which scripts/deploy_checks.py does not model")
        options = generator.get("options", {})
        if options.get("disableNameSuffixHash"):
            problem(at, "disableNameSuffixHash: without the hash in its name, a changed setting does not roll the pods")
        data = {}
        for env in generator.get("envs", []):
            path = directory / env
            if not path.is_file():
                problem(at, f"reads {env}, which does not exist")
                continue
            used.add(env)
            data.update(read_env_file(path))
        if not data:
            problem(at, "generates an empty ConfigMap")
        generated[name] = {"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": name, "labels": options.get("labels", {})}, "data": data}
    for path in sorted(directory.iterdir()):
        if path.is_dir():
            if directory == K8S and path.name in ADDONS:
                continue
            problem(where, f"{path.name}/ is neither a resource nor a kustomization deploy_checks.py knows (ADDONS)")
        elif path.name not in used and path.name not in UNLISTED:
            problem(where, f"does not list {path.name} (list it, or say why not in UNLISTED, scripts/deploy_checks.py)")
    return documents, generated, bases


def check_k8s(rendered=None):
    documents, generated, bases = read_kustomization(K8S)
    where = "deploy/k8s"
    if bases:
        problem(f"{where}/kustomization.yaml", "the base lists directories; deploy_checks.py expects only files")
    objects = {}
    for document in documents:
        objects[(document["kind"], document["metadata"]["name"])] = document
    known = documented_variables()
    for (kind, name) in list(objects):
        if kind == "ConfigMap":
            problem(f"{where}: ConfigMap {name}", "comes from a resource file: generate it with configMapGenerator, "
                    "so that a change to it rolls the pods")
    for name, configmap in generated.items():
        objects[("ConfigMap", name)] = configmap
    configmaps = {name: doc for (kind, name), doc in objects.items() if kind == "ConfigMap"}
    secrets = {name: doc for (kind, name), doc in objects.items() if kind == "Secret"}
    for name, doc in configmaps.items():
        check_variables(f"{where}: ConfigMap {name}", doc.get("data", {}), known)
    for name, doc in secrets.items():
        check_variables(f"{where}: Secret {name}", doc.get("stringData", {}), known)

    deployments = [doc for (kind, _), doc in objects.items() if kind == "Deployment"]
    if len(deployments) != 1:
        problem(where, f"expected one Deployment, found {len(deployments)}")
        return
    deployment = deployments[0]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"].get("labels", {})
    container = pod["spec"]["containers"][0]
    at = f"{where}: Deployment {deployment['metadata']['name']}"

    settings, referenced = {}, set()
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            ref = source["configMapRef"]["name"]
            referenced.add(ref)
            # kustomize rewrites a reference to the hashed name only when it
            # names a generated ConfigMap.
            if ref not in generated:
                problem(at, f"envFrom names ConfigMap {ref}, configMapGenerator makes {sorted(generated)}")
            settings.update(configmaps.get(ref, {}).get("data", {}))
        if "secretRef" in source:
            ref = source["secretRef"]["name"]
            if ref not in secrets:
                problem(at, f"envFrom names Secret {ref}, which is not in the kustomization")
            settings.update(secrets.get(ref, {}).get("stringData", {}))
    for name in generated.keys() - referenced:
        problem(f"{where}/kustomization.yaml", f"generates ConfigMap {name}, which the Deployment does not use")
    env = {item["name"]: item for item in container.get("env", [])}
    check_variables(at, env, known)
    for required in ("TASKBROKER_DATABASE_URL", "TASKBROKER_WORKER_ENDPOINTS", "TASKBROKER_GRPC_SHARED_SECRETS"):
        if required not in settings:
            problem(at, f"{required} comes from neither the ConfigMap nor the Secret")
    advertised = env.get("TASKBROKER_GRPC_ADVERTISED_ADDR", {})
    pod_ip = env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if pod_ip != "status.podIP" or "$(POD_IP)" not in advertised.get("value", ""):
        problem(at, "TASKBROKER_GRPC_ADVERTISED_ADDR is not built from the pod IP (downward API)")
    names = list(env)
    if "POD_IP" in names and "TASKBROKER_GRPC_ADVERTISED_ADDR" in names and \
            names.index("POD_IP") > names.index("TASKBROKER_GRPC_ADVERTISED_ADDR"):
        problem(at, "POD_IP must be defined before the variable that refers to it")

    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    metrics_port = port_of(settings.get("TASKBROKER_METRICS_ADDR", "0.0.0.0:9090"))
    grpc_port = port_of(settings.get("TASKBROKER_GRPC_ADDR", "0.0.0.0:50051"))
    if ports.get("metrics") != metrics_port:
        problem(at, f"port metrics is {ports.get('metrics')}, TASKBROKER_METRICS_ADDR listens on {metrics_port}")
    if ports.get("grpc") != grpc_port:
        problem(at, f"port grpc is {ports.get('grpc')}, TASKBROKER_GRPC_ADDR listens on {grpc_port}")
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        get = container.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") not in ("metrics", metrics_port):
            problem(at, f"{probe} must GET {path} on the metrics port, not {get}")
    timeout_ms = int(settings.get("TASKBROKER_SHUTDOWN_TIMEOUT_MS", "30000"))
    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if grace <= timeout_ms / 1000:
        problem(at, f"terminationGracePeriodSeconds {grace} does not exceed the shutdown timeout {timeout_ms} ms")
    security = pod["spec"].get("securityContext", {})
    if not security.get("runAsNonRoot") or not security.get("runAsUser"):
        problem(at, "the pod must run as a non-root user")
    resources = container.get("resources", {})
    if not resources.get("requests") or not resources.get("limits"):
        problem(at, "the container needs resource requests and limits")

    selector = deployment["spec"]["selector"]["matchLabels"]
    if any(labels.get(k) != v for k, v in selector.items()):
        problem(at, "the selector does not match the pod labels")
    worker_urls = settings.get("TASKBROKER_WORKER_ENDPOINTS", "")
    broker_services = []
    for (kind, name), doc in objects.items():
        if kind == "Service" and doc["spec"].get("selector", {}).get("app.kubernetes.io/name") == "taskworker":
            # The workers' Service: headless, so the broker sees every pod,
            # and on the port the broker's worker URLs name.
            at_service = f"{where}: Service {name}"
            if doc["spec"].get("clusterIP") != "None":
                problem(at_service, "the workers' Service must be headless (clusterIP: None)")
            service_ports = {port["port"] for port in doc["spec"].get("ports", [])}
            named = {int(port) for port in re.findall(rf"//{re.escape(name)}:(\d+)", worker_urls)}
            if not named:
                problem(at_service, "TASKBROKER_WORKER_ENDPOINTS names no URL of this Service")
            for port in named - service_ports:
                problem(at_service, f"TASKBROKER_WORKER_ENDPOINTS uses port {port}, the Service has {sorted(service_ports)}")
            continue
        if kind == "Service":
            chosen = doc["spec"].get("selector", {})
            target_ports = {port.get("targetPort") for port in doc["spec"].get("ports", [])}
            broker_services.append(doc)
        elif kind == "PodDisruptionBudget":
            chosen = doc["spec"]["selector"].get("matchLabels", {})
            target_ports = set()
        else:
            continue
        if not chosen or any(labels.get(k) != v for k, v in chosen.items()):
            problem(f"{where}: {kind} {name}", "its selector does not match the broker pods")
        for target in target_ports - set(ports) - set(ports.values()):
            problem(f"{where}: {kind} {name}", f"targets port {target}, which the pod does not declare")
    print(f"k8s: {len(objects)} objects from {len(documents)} documents and {len(generated)} generated ConfigMap(s); "
          "kustomization files, variables, ports, probes, grace period, security context and selectors checked")

    monitoring = check_prometheus_operator(objects, broker_services, metrics_port)
    if rendered:
        check_rendered(documents, generated, monitoring, *rendered)
    else:
        # validate-deploy says why it rendered nothing; the checks above read
        # the kustomizations the way kustomize does.
        print("k8s: no kustomize output given, so none checked")


def check_prometheus_operator(base, broker_services, metrics_port):
    """deploy/k8s/prometheus-operator, applied next to the base: a
    ServiceMonitor on the broker Service's metrics port and a PrometheusRule
    that is deploy/prometheus/alerts.yml. Returns its documents."""
    where = relative(OPERATOR)
    documents, generated, bases = read_kustomization(OPERATOR)
    if bases or generated:
        # kustomize refuses ../ from inside the base's directory, and the
        # base generates the ConfigMap.
        problem(f"{where}/kustomization.yaml", "must list only its own files")
    for document in documents:
        if (document.get("kind"), document.get("metadata", {}).get("name")) in base:
            problem(where, f"{document.get('kind')} {document['metadata']['name']} is in the base too")
    kinds = sorted(document.get("kind") for document in documents)
    if kinds != ["PrometheusRule", "ServiceMonitor"]:
        problem(where, f"expected one ServiceMonitor and one PrometheusRule, found {kinds}")
    for document in documents:
        if document.get("apiVersion") != "monitoring.coreos.com/v1":
            problem(where, f"{document.get('kind')} has apiVersion {document.get('apiVersion')}, "
                           "not monitoring.coreos.com/v1")
        if document.get("kind") == "ServiceMonitor":
            check_servicemonitor(f"{where}: ServiceMonitor {document['metadata']['name']}", document,
                                 base, broker_services, metrics_port)
        elif document.get("kind") == "PrometheusRule":
            compare_rule_groups(f"{where}: PrometheusRule {document['metadata']['name']}",
                                document.get("spec", {}).get("groups", []))
    print(f"prometheus-operator: {', '.join(kinds)}; the ServiceMonitor's Service, port and job name, and the "
          "PrometheusRule against deploy/prometheus/alerts.yml checked")
    return documents


def check_servicemonitor(at, monitor, base, broker_services, metrics_port):
    spec = monitor.get("spec", {})
    selector = spec.get("selector", {})
    if selector.get("matchExpressions"):
        problem(at, "selects with matchExpressions, which deploy_checks.py does not model: use matchLabels")
    wanted = selector.get("matchLabels", {})
    # A ServiceMonitor picks Services by the Services' own labels (not their
    # selectors), in its namespace unless namespaceSelector says otherwise.
    if spec.get("namespaceSelector"):
        problem(at, "has a namespaceSelector: it must watch the namespace the base is applied to")
    chosen = [doc for (kind, _), doc in base.items() if kind == "Service" and wanted and
              all(doc["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
    if len(chosen) != 1 or chosen[0] not in broker_services:
        problem(at, f"selects the Services {[doc['metadata']['name'] for doc in chosen]}; "
                    f"it must select the broker's Service alone")
        return
    service = chosen[0]
    service_ports = {port.get("name"): port for port in service["spec"].get("ports", [])}
    for endpoint in spec.get("endpoints", []):
        port = service_ports.get(endpoint.get("port"))
        if port is None:
            problem(at, f"scrapes port {endpoint.get('port')!r}, which Service {service['metadata']['name']} "
                        f"does not name (it has {sorted(service_ports)})")
        elif port.get("targetPort") not in ("metrics", metrics_port):
            problem(at, f"scrapes port {endpoint['port']}, which leads to the pod's {port.get('targetPort')}, "
                        "not its metrics port")
        if endpoint.get("path", "/metrics") != "/metrics":
            problem(at, f"scrapes {endpoint['path']}, the broker serves /metrics")
    if not spec.get("endpoints"):
        problem(at, "has no endpoints")
    # The operator names the job after the Service, or after the Service's
    # label that jobLabel names.
    if spec.get("jobLabel"):
        job = service["metadata"].get("labels", {}).get(spec["jobLabel"])
    else:
        job = service["metadata"]["name"]
    if job != SCRAPE_JOB:
        problem(at, f"Prometheus would call the job {job!r}; the alerts expect {SCRAPE_JOB!r}")


def rule_name(rule):
    return rule.get("alert") or rule.get("record") or "an unnamed rule"


def compare_rule_groups(at, groups):
    """The PrometheusRule's groups must be alerts.yml's, field for field.
    Names every difference it can attribute, and falls back on the whole
    (order, group settings) for the rest."""
    source = relative(ALERTS)
    expected = load_yaml(ALERTS).get("groups", [])
    fix = "(regenerate it: scripts/deploy_checks.py prometheusrule)"
    before = len(PROBLEMS)
    names = [group.get("name") for group in groups]
    expected_names = [group.get("name") for group in expected]
    if names != expected_names:
        problem(at, f"has the groups {names}, {source} has {expected_names} {fix}")
    expected_groups = {group.get("name"): group for group in expected}
    for group in groups:
        other = expected_groups.get(group.get("name"))
        if other is None:
            continue
        rules = {rule_name(rule): rule for rule in group.get("rules", [])}
        others = {rule_name(rule): rule for rule in other.get("rules", [])}
        for name in sorted(others.keys() - rules.keys()):
            problem(at, f"group {group['name']} lacks {name}, which {source} has {fix}")
        for name in sorted(rules.keys() - others.keys()):
            problem(at, f"group {group['name']} has {name}, which {source} does not {fix}")
        for name in sorted(rules.keys() & others.keys()):
            for field in sorted(set(rules[name]) | set(others[name])):
                ours, theirs = rules[name].get(field), others[name].get(field)
                if isinstance(ours, dict) and isinstance(theirs, dict):
                    # labels, annotations: name the key that differs
                    pairs = [(f"{field}.{key}", ours.get(key), theirs.get(key))
                             for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]
                else:
                    pairs = [(field, ours, theirs)] if ours != theirs else []
                for what, mine, wanted in pairs:
                    problem(at, f"{name}: {what} is {mine!r}, in {source} {wanted!r} {fix}")
    if groups != expected and len(PROBLEMS) == before:
        problem(at, f"differs from {source} in rule order or group settings {fix}")
    if not expected:
        problem(source, "has no rule groups")


# The PrometheusRule around alerts.yml's groups: written by
# `deploy_checks.py prometheusrule`, compared by `deploy_checks.py k8s`.
PROMETHEUSRULE_HEAD = """\
# Generated from deploy/prometheus/alerts.yml by `scripts/deploy_checks.py
# prometheusrule`: edit alerts.yml and run that, not this file.
# scripts/validate-deploy fails while the two differ.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: taskbroker
  labels:
    app.kubernetes.io/name: taskbroker
    app.kubernetes.io/component: broker
spec:
"""


def write_prometheusrule():
    lines = ALERTS.read_text(encoding="utf-8").splitlines()
    # alerts.yml's header comment speaks of that file: copy from `groups:` on,
    # indented under spec, so the text (block scalars, comments) is kept.
    start = next((i for i, line in enumerate(lines) if line.startswith("groups:")), None)
    if start is None:
        problem(relative(ALERTS), "has no top-level `groups:`")
        return
    body = "".join(f"  {line}\n" if line.strip() else "\n" for line in lines[start:])
    PROMETHEUSRULE.write_text(PROMETHEUSRULE_HEAD + body, encoding="utf-8")
    compare_rule_groups(relative(PROMETHEUSRULE), load_yaml(PROMETHEUSRULE)["spec"]["groups"])
    print(f"prometheusrule: wrote {relative(PROMETHEUSRULE)} from {relative(ALERTS)}")


def check_rendered(documents, generated, monitoring, base_out, combined_out):
    """What kustomize rendered (validate-deploy runs kubectl kustomize or
    kustomize build) of the base and of a kustomization listing the base and
    prometheus-operator, against the model above: the generated ConfigMap
    has a hash in its name and the env file's data, the Deployment refers to
    the hashed name, and the two directories combine without a conflict."""
    where = "deploy/k8s (rendered)"
    rendered = load_yaml_documents(base_out)
    configmaps = [doc for doc in rendered if doc["kind"] == "ConfigMap"]
    references = [source["configMapRef"]["name"]
                  for doc in rendered if doc["kind"] == "Deployment"
                  for container in doc["spec"]["template"]["spec"]["containers"]
                  for source in container.get("envFrom", []) if "configMapRef" in source]
    for name, model in generated.items():
        hashed = [doc for doc in configmaps
                  if re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}", doc["metadata"]["name"])]
        if len(hashed) != 1:
            problem(where, f"expected one ConfigMap {name}-<hash>, found {[d['metadata']['name'] for d in configmaps]}")
            continue
        configmap = hashed[0]
        if configmap.get("data") != model["data"]:
            problem(where, f"ConfigMap {configmap['metadata']['name']} holds {configmap.get('data')}, "
                           f"deploy_checks.py read {model['data']} from the env file")
        if configmap["metadata"]["name"] not in references:
            problem(where, f"the Deployment refers to the ConfigMaps {references}, not to the generated "
                           f"{configmap['metadata']['name']}")
    expected = sorted((doc["kind"], doc["metadata"]["name"]) for doc in documents)
    found = sorted((doc["kind"], doc["metadata"]["name"]) for doc in rendered if doc["kind"] != "ConfigMap")
    if expected != found:
        problem(where, f"renders {found} besides the ConfigMaps, the resource files hold {expected}")

    combined = load_yaml_documents(combined_out)

    def canonical(docs):
        return sorted(json.dumps(doc, sort_keys=True) for doc in docs)

    if canonical(combined) != canonical(rendered + monitoring):
        problem(f"{relative(OPERATOR)} (rendered with the base)",
                "is not the rendered base plus servicemonitor.yaml and prometheusrule.yaml, unchanged")
    print(f"k8s: kustomize output checked: {len(rendered)} objects in the base, the generated ConfigMap's hashed "
          f"name in the Deployment; {len(combined)} with prometheus-operator")


# --- Grafana -----------------------------------------------------------------

# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$instance": ".*",
}


def check_grafana(rules_out):
    path = DEPLOY / "grafana" / "taskbroker.json"
    where = "deploy/grafana/taskbroker.json"
    with open(path, encoding="utf-8") as handle:
        dashboard = json.load(handle)
    for field in ("title", "uid", "panels", "schemaVersion", "templating"):
        if field not in dashboard:
            problem(where, f"no {field}: not a dashboard model")
    if not isinstance(dashboard.get("schemaVersion"), int):
        problem(where, "schemaVersion must be a number")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource" or \
            variables.get("datasource", {}).get("query") != "prometheus":
        problem(where, "needs a `datasource` variable of Prometheus data sources")
    if "instance" not in variables:
        problem(where, "needs an `instance` variable")

    panels = dashboard.get("panels", [])
    seen_ids, cells, expressions = set(), {}, []
    for index, panel in enumerate(panels):
        at = f"{where}: panel {panel.get('id', index)} ({panel.get('title', 'untitled')})"
        if not panel.get("title"):
            problem(at, "has no title")
        if not isinstance(panel.get("id"), int) or panel["id"] in seen_ids:
            problem(at, "needs an id unique in the dashboard")
        seen_ids.add(panel.get("id"))
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")):
            problem(at, f"gridPos needs whole numbers h, w, x, y: {grid}")
            continue
        if grid["w"] < 1 or grid["h"] < 1 or grid["x"] < 0 or grid["x"] + grid["w"] > 24:
            problem(at, f"gridPos {grid} does not fit the 24-column grid")
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                if (x, y) in cells:
                    problem(at, f"overlaps panel {cells[(x, y)]}")
                    break
                cells[(x, y)] = panel.get("id")
            else:
                continue
            break
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets", [])
        if not targets:
            problem(at, "has no targets")
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            problem(at, "must query the data source the `datasource` variable selects")
        ref_ids = [t.get("refId") for t in targets]
        if len(set(ref_ids)) != len(ref_ids):
            problem(at, f"refIds repeat: {ref_ids}")
        for target in targets:
            expr = target.get("expr", "")
            if "taskbroker_" not in expr:
                problem(at, f"target {target.get('refId')} does not query a taskbroker metric: {expr!r}")
            if 'instance=~"$instance"' not in expr:
                problem(at, f"target {target.get('refId')} ignores the instance selection")
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            if "$" in expr:
                problem(at, f"target {target.get('refId')} uses an unknown variable: {expr}")
            expressions.append((panel.get("id"), target.get("refId"), expr))

    # Every query as a recording rule, so promtool parses the PromQL.
    rules = [{"record": f"dashboard:panel_{panel_id}:{ref_id.lower()}", "expr": expr}
             for panel_id, ref_id, expr in expressions]
    with open(rules_out, "w", encoding="utf-8") as handle:
        yaml.safe_dump({"groups": [{"name": "dashboard_queries", "rules": rules}]}, handle, sort_keys=False)
    print(f"grafana: {len(panels)} panels with unique ids and non-overlapping gridPos, "
          f"{len(expressions)} queries written to {rules_out} for promtool")


# --- alerts ------------------------------------------------------------------


def check_alerts():
    rules = load_yaml(DEPLOY / "prometheus" / "alerts.yml")
    operations = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    count = 0
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            if "alert" not in rule:
                continue
            count += 1
            at = f"deploy/prometheus/alerts.yml: {rule['alert']}"
            if not rule.get("for"):
                problem(at, "has no `for:`")
            if rule.get("labels", {}).get("severity") not in ("warning", "critical"):
                problem(at, "needs a severity label, warning or critical")
            for annotation in ("summary", "description"):
                if not rule.get("annotations", {}).get(annotation):
                    problem(at, f"needs a {annotation} annotation")
            if f"`{rule['alert']}`" not in operations:
                problem(at, "is not explained in docs/operations.md")
    if count == 0:
        problem("deploy/prometheus/alerts.yml", "no alerts")
    print(f"alerts: {count} alerts have for, severity, summary, description and a section in docs/operations.md")


def main(argv):
    commands = {"compose": check_compose, "k8s": check_k8s, "alerts": check_alerts,
                "prometheusrule": write_prometheusrule}
    if len(argv) == 3 and argv[1] == "grafana":
        check_grafana(argv[2])
    elif len(argv) == 4 and argv[1] == "k8s":
        check_k8s(argv[2:])
    elif len(argv) == 2 and argv[1] in commands:
        commands[argv[1]]()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for line in PROBLEMS:
        print(f"  FAIL {line}", file=sys.stderr)
    return 1 if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
