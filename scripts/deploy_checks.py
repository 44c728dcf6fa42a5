#!/usr/bin/env python3
"""Consistency checks of deploy/ that no schema expresses, run by
scripts/validate-deploy (which validates the schemas themselves).

    deploy_checks.py compose            the compose file against itself, the
                                        Prometheus and Grafana files it mounts,
                                        and docs/configuration.md
    deploy_checks.py k8s                the manifests against each other and
                                        docs/configuration.md
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


def check_k8s():
    directory = DEPLOY / "k8s"
    kustomization = load_yaml(directory / "kustomization.yaml")
    listed = kustomization.get("resources", [])
    files = sorted(p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml")
    for name in listed:
        if not (directory / name).is_file():
            problem("deploy/k8s/kustomization.yaml", f"lists {name}, which does not exist")
    for name in files:
        if name not in listed:
            problem("deploy/k8s/kustomization.yaml", f"does not list {name}")

    objects = {}
    for name in files:
        for document in load_yaml_documents(directory / name):
            objects[(document["kind"], document["metadata"]["name"])] = document
    known = documented_variables()
    where = "deploy/k8s"
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

    settings = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            ref = source["configMapRef"]["name"]
            if ref not in configmaps:
                problem(at, f"envFrom names ConfigMap {ref}, which is not in the kustomization")
            settings.update(configmaps.get(ref, {}).get("data", {}))
        if "secretRef" in source:
            ref = source["secretRef"]["name"]
            if ref not in secrets:
                problem(at, f"envFrom names Secret {ref}, which is not in the kustomization")
            settings.update(secrets.get(ref, {}).get("stringData", {}))
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
        elif kind == "PodDisruptionBudget":
            chosen = doc["spec"]["selector"].get("matchLabels", {})
            target_ports = set()
        else:
            continue
        if not chosen or any(labels.get(k) != v for k, v in chosen.items()):
            problem(f"{where}: {kind} {name}", "its selector does not match the broker pods")
        for target in target_ports - set(ports) - set(ports.values()):
            problem(f"{where}: {kind} {name}", f"targets port {target}, which the pod does not declare")
    print(f"k8s: {len(objects)} objects in {len(files)} files; kustomization, variables, ports, probes, "
          "grace period, security context and selectors checked")


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
    commands = {"compose": check_compose, "k8s": check_k8s, "alerts": check_alerts}
    if len(argv) == 3 and argv[1] == "grafana":
        check_grafana(argv[2])
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
