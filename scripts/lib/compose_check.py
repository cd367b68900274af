#!/usr/bin/env python3
"""Bring a compose file of compose/ up on the private Docker engine and check that it carries
purchases (python3 stdlib only; run by `scripts/dev compose`, which starts the engine, builds
the images and sets DOCKER_HOST).

usage: compose_check.py up|test|down STATE_DIR [--cluster] [--no-build]

  up     docker-compose up (every service but Grafana, with the fake App Store and the demo
         client), published on free 127.0.0.1 ports; writes STATE_DIR/compose-<file>.json
  test   up, the checks below, then `down -v`
  down   `down -v` of the stacks recorded in STATE_DIR

The single-node file (docker-compose.yml): every service healthy, the image's resource bundles
beside the binary, the console answers, the demo purchase credited; `--scale verifier=3`, then
IAP_COMPOSE_PURCHASES (default 200) purchases through the intake's published port, each
credited once, and each verifier consumed some (its /metrics); `docker kill` of the order
service mid-stream and `up` again: nothing lost or doubled; Prometheus reports every target up.

The cluster file (docker-compose.cluster.yml): each node's plugin list readable by user
rabbitmq; the three nodes one cluster, and the nodes' health check failing on a lone node;
HAProxy running with maxconn under the container's open-file limit; every quorum queue with
three members; two order services behind HAProxy on PostgreSQL; `docker kill` of the RabbitMQ
node the services use, mid-stream: every accepted purchase credited once; the node's restart
rejoins; Prometheus reports every target up.

The test talks to the stack only through the ports published on 127.0.0.1 (and `docker exec`).
"""
import concurrent.futures
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_purchase import user_token  # noqa: E402  (the demo's HS256 user token)
from net import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
DOCKER = "/usr/bin/docker"
COMPOSE = "/usr/bin/docker-compose"
BUNDLE_ID = "com.example.demo"
PRODUCT_ID = "com.example.coins.60"
COINS = 60
# The resource bundles SwiftPM builds beside the binary (compose/Dockerfile copies them).
BUNDLES = ["iap-pipeline_AppStore.resources", "iap-pipeline_Console.resources", "GRDB_GRDB.resources"]
T0 = time.monotonic()
PASSED = [0]


class CheckFailed(Exception):
    pass


def say(message: str) -> None:
    print(f"==> [{time.monotonic() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)
    PASSED[0] += 1
    say(f"ok: {message}")


class Stage:
    """`with Stage("name"):` prints the stage and its time."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.start = time.monotonic()
        say(f"stage: {self.name}")

    def __exit__(self, kind, value, tb) -> None:
        outcome = "done" if kind is None else "FAILED"
        say(f"stage {outcome}: {self.name} ({time.monotonic() - self.start:.1f}s)")


def run(args: list[str], check_rc: bool = True, timeout: float = 900, quiet: bool = False) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check_rc and proc.returncode != 0:
        raise CheckFailed(f"{shlex.join(args)} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# The stack


class Stack:
    def __init__(self, state_dir: Path, cluster: bool) -> None:
        self.cluster = cluster
        self.file = "docker-compose.cluster.yml" if cluster else "docker-compose.yml"
        self.project = "iap-compose-cluster" if cluster else "iap-compose"
        self.state_file = state_dir / f"compose-{'cluster' if cluster else 'single'}.json"
        self.env_file = state_dir / f"compose-{'cluster' if cluster else 'single'}.env"
        self.state: dict = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    # The services started: all but Grafana (no stand-in image: its files are checked statically).
    def services(self) -> list[str]:
        if self.cluster:
            return ["rabbitmq-1", "rabbitmq-2", "rabbitmq-3", "postgres", "orders-1", "orders-2", "lb",
                    "verifier", "fake-appstore", "demo", "prometheus"]
        return ["rabbitmq", "orders", "verifier", "fake-appstore", "demo", "prometheus"]

    def compose(self, *args: str, timeout: float = 900) -> str:
        return run([COMPOSE, "-p", self.project, "-f", str(COMPOSE_DIR / self.file),
                    "--env-file", str(self.env_file), "--profile", "dev", *args], timeout=timeout)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.state['ports'][name]}"

    def containers(self, service: str) -> list[str]:
        out = run([DOCKER, "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                   "--filter", f"label=com.docker.compose.service={service}"])
        return out.split()

    def container(self, service: str) -> str:
        ids = self.containers(service)
        if len(ids) != 1:
            raise CheckFailed(f"expected one container of {service}, found {len(ids)}")
        return ids[0]

    def exec(self, service: str, *command: str, user: str | None = None, check_rc: bool = True) -> str:
        return run([DOCKER, "exec", *(["-u", user] if user else []), self.container(service), *command],
                   check_rc=check_rc, timeout=120)

    def write_settings(self) -> None:
        names = ["http", "admin", "fake", "prometheus", "grafana", "rabbitmq_ui"]
        ports = dict(zip(names, free_ports(len(names), [])))
        self.state = {"file": self.file, "project": self.project, "ports": ports,
                      "secret": secrets.token_hex(32), "admin_token": secrets.token_hex(16)}
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self.state, indent=2))
        settings = {
            # Only on 127.0.0.1, on ports found free (a developer's own stack keeps 8080, 8090).
            "IAP_PUBLISH_ADDRESS": "127.0.0.1",
            "IAP_PUBLISH_HTTP_PORT": ports["http"],
            "IAP_PUBLISH_ADMIN_PORT": ports["admin"],
            "IAP_PUBLISH_FAKE_APPSTORE_PORT": ports["fake"],
            "IAP_PUBLISH_PROMETHEUS_PORT": ports["prometheus"],
            "IAP_PUBLISH_GRAFANA_PORT": ports["grafana"],
            "IAP_PUBLISH_RABBITMQ_UI_PORT": ports["rabbitmq_ui"],
            "IAP_BUNDLE_IDS": BUNDLE_ID,
            "IAP_AUTH": "jwt",
            "IAP_AUTH_HS256_SECRET": self.state["secret"],
            "IAP_ADMIN_TOKEN": self.state["admin_token"],
            # Every upload of the test comes from one address.
            "IAP_RATE_LIMIT_PER_IP": "0",
            "IAP_REFUSALS_PER_IP": "0",
            "IAP_APPSTORE_VERIFY_URL": "http://fake-appstore:8090/verifyReceipt",
            "IAP_APPSTORE_SANDBOX_VERIFY_URL": "http://fake-appstore:8090/sandbox/verifyReceipt",
            "SWIFT_IMAGE": "swift:6.2-bookworm",
        }
        # Its own settings file: a developer's compose/.env is not read.
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        if self.cluster:
            self.ensure_cluster_secrets()

    def ensure_cluster_secrets(self) -> None:
        """The cluster file's secrets, made as its header says when compose/secrets/ lacks them."""
        folder = COMPOSE_DIR / "secrets"
        made = []
        for name, size in [("rabbitmq-erlang-cookie", 32), ("rabbitmq-password", 24), ("postgres-password", 24)]:
            path = folder / name
            if not path.exists():
                path.write_text(secrets.token_hex(size) + "\n")
                made.append(name)
        urls = folder / "amqp-urls"
        if not urls.exists():
            password = (folder / "rabbitmq-password").read_text().strip()
            urls.write_text(",".join(f"amqp://iap:{password}@rabbitmq-{n}:5672/" for n in (1, 2, 3)) + "\n")
            made.append("amqp-urls")
        (folder / "appstore").mkdir(exist_ok=True)
        for name in ["rabbitmq-erlang-cookie", "rabbitmq-password", "postgres-password", "amqp-urls"]:
            os.chmod(folder / name, 0o644)  # the iap containers run as uid 10001
        if made:
            say(f"made compose/secrets/{{{','.join(made)}}}")

    def build(self) -> None:
        # One image for both files (both name iap-pipeline:local): built from compose/Dockerfile
        # as a user builds it, through docker-compose; BuildKit's cache makes a rebuild cheap.
        self.compose("build", "orders-1" if self.cluster else "orders", timeout=3600)

    def up(self, *extra: str, demo: bool = True) -> None:
        # Later `up`s leave the one-shot demo client alone (it would run again).
        services = [s for s in self.services() if demo or s != "demo"]
        self.compose("up", "-d", "--no-build", *extra, *services, timeout=600)

    def down(self) -> None:
        if not self.env_file.exists():
            return
        self.compose("down", "-v", "--remove-orphans", timeout=300)
        self.state_file.unlink(missing_ok=True)
        self.env_file.unlink(missing_ok=True)

    def inspect(self, container: str) -> dict:
        return json.loads(run([DOCKER, "inspect", container]))[0]

    def wait_healthy(self, timeout: float = 300) -> None:
        """Every container of the stack but the one-shot demo running, and healthy where it
        has a health check."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = []
            for service in self.services():
                if service == "demo":
                    continue
                ids = self.containers(service)
                if not ids:
                    waiting.append(f"{service}: no container")
                for cid in ids:
                    info = self.inspect(cid)
                    state = info["State"]
                    health = state.get("Health", {}).get("Status")
                    if state["Status"] != "running" or health not in (None, "healthy"):
                        waiting.append(f"{info['Name'].lstrip('/')}: {state['Status']}"
                                       f"{'/' + health if health else ''} (restarts {info['RestartCount']})")
            if not waiting:
                return
            if time.monotonic() > deadline:
                for line in waiting:
                    print(f"    {line}", file=sys.stderr)
                for name in [w.split(":")[0] for w in waiting][:3]:
                    logs = subprocess.run([DOCKER, "logs", "--tail", "15", name], capture_output=True, text=True)
                    print(f"---- {name}\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}", file=sys.stderr)
                raise CheckFailed(f"not healthy after {timeout:.0f}s: {'; '.join(waiting)}")
            time.sleep(2)


# ---------------------------------------------------------------------------------------------
# HTTP through the published ports


def http(method: str, url: str, body: object = None, token: str | None = None,
         timeout: float = 10) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


class Purchase:
    def __init__(self, stack: Stack, label: str, index: int) -> None:
        self.user = f"compose-{label}-{index}-{secrets.token_hex(3)}"
        self.token = user_token(stack.state["secret"], self.user)
        self.transaction_id = ""
        self.receipt = ""
        self.submissions: list[str] = []
        self.failed_attempts = 0


def mint(stack: Stack, purchase: Purchase) -> None:
    status, body = http("POST", stack.url("fake") + "/fake/purchases",
                        {"bundleId": BUNDLE_ID, "productId": PRODUCT_ID, "environment": "Production"})
    if status != 201 or not isinstance(body, dict):
        raise CheckFailed(f"fake App Store mint: {status} {body}")
    purchase.transaction_id, purchase.receipt = body["transactionId"], body["receiptData"]


def upload(stack: Stack, purchase: Purchase, patience: float = 180) -> None:
    """POST /v1/receipts until one answer is 202; a refused connection, a reset or a 5xx
    (the order service or a broker node is down) is tried again, as an app would."""
    deadline = time.monotonic() + patience
    while True:
        try:
            status, body = http("POST", stack.url("http") + "/v1/receipts",
                                {"receiptData": purchase.receipt}, token=purchase.token)
            if status == 202 and isinstance(body, dict) and body.get("submissionId"):
                purchase.submissions.append(body["submissionId"])
                return
            if status < 500 and status != 429:
                raise CheckFailed(f"upload for {purchase.user}: {status} {body}")
        except (urllib.error.URLError, OSError):
            pass
        purchase.failed_attempts += 1
        if time.monotonic() > deadline:
            raise CheckFailed(f"upload for {purchase.user} not accepted within {patience:.0f}s")
        time.sleep(0.5)


def credited_once(stack: Stack, purchase: Purchase) -> str | None:
    """None when the purchase is credited exactly once, else what is wrong."""
    status, body = http("GET", f"{stack.url('http')}/v1/users/{purchase.user}/entitlements", token=purchase.token)
    if status != 200 or not isinstance(body, dict):
        return f"entitlements {status} {body}"
    status, grants = http("GET", f"{stack.url('http')}/v1/users/{purchase.user}/grants", token=purchase.token)
    if status != 200 or not isinstance(grants, dict):
        return f"grants {status} {grants}"
    mine = [g for g in grants.get("grants", []) if g.get("transactionId") == purchase.transaction_id]
    coins = body.get("balances", {}).get("coins", 0)
    if len(mine) == 1 and len(grants["grants"]) == 1 and coins == COINS:
        return None
    return f"{len(mine)} grants for {purchase.transaction_id}, {len(grants.get('grants', []))} in all, {coins} coins"


def wait_all_credited(stack: Stack, purchases: list[Purchase], timeout: float = 240) -> None:
    """Every purchase credited exactly once (its user holds one grant and COINS coins), and each
    of its accepted submissions reads `credited`."""
    deadline = time.monotonic() + timeout
    pending = list(purchases)
    problems: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        while pending:
            results = list(pool.map(lambda p: (p, credited_once(stack, p)), pending))
            problems = {p.user: why for p, why in results if why}
            pending = [p for p, why in results if why]
            # A grant beyond the first is a double credit: no need to wait for it to go away.
            doubled = {u: w for u, w in problems.items() if w.startswith(("2 ", "3 "))}
            if doubled:
                raise CheckFailed(f"credited more than once: {doubled}")
            if not pending:
                break
            if time.monotonic() > deadline:
                raise CheckFailed(f"{len(pending)} of {len(purchases)} purchases not credited once "
                                  f"after {timeout:.0f}s, e.g. {list(problems.items())[:3]}")
            time.sleep(1)
        states = list(pool.map(
            lambda p: [http("GET", f"{stack.url('http')}/v1/receipts/{s}", token=p.token)[1] for s in p.submissions],
            purchases))
    bad = [s for subs in states for s in subs if not (isinstance(s, dict) and s.get("state") == "credited")]
    check(not bad, f"{len(purchases)} purchases credited exactly once each (one grant, {COINS} coins per user), "
                   f"every accepted upload reads credited")


def send_purchases(stack: Stack, label: str, count: int, fault=None, recover=None, workers: int = 8) -> list[Purchase]:
    """Mint COUNT purchases and upload them (WORKERS at a time). With FAULT, a third are uploaded
    first, then `fault()` runs and returns once the fault has landed (the container is dead),
    then `recover()` (if any) starts beside the uploads of the rest: those are all sent after
    the fault landed, so the drill never passes or fails on how fast the first ones went."""
    purchases = [Purchase(stack, label, i) for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: mint(stack, p), purchases))
    start = time.monotonic()
    first, rest = (purchases[:count // 3], purchases[count // 3:]) if fault is not None else ([], purchases)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: upload(stack, p), first))
    recovering = None
    if fault is not None:
        fault()
        if recover is not None:
            recovering = threading.Thread(target=recover)
            recovering.start()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: upload(stack, p), rest))
    if recovering is not None:
        recovering.join()
    retried = sum(1 for p in purchases if p.failed_attempts)
    say(f"{count} uploads accepted in {time.monotonic() - start:.1f}s ({retried} needed more than one try)")
    return purchases


# ---------------------------------------------------------------------------------------------
# Checks shared by both files


def ops_metric(stack: Stack, container: str, name: str) -> float:
    """The sum of a metric's samples on a container's /metrics (IAP_OPS_PORT 9100), read from
    inside the container (the runtime image has bash, not curl)."""
    # HTTP/1.0 (no chunks) with Connection: close, so that the server ends the stream.
    script = ("exec 3<>/dev/tcp/127.0.0.1/9100 && printf 'GET /metrics HTTP/1.0\\r\\nHost: localhost\\r\\n"
              "Connection: close\\r\\n\\r\\n' >&3 && timeout 10 cat <&3 || true")
    out = run([DOCKER, "exec", container, "bash", "-c", script], timeout=30)
    total = 0.0
    for line in out.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def check_image(stack: Stack) -> None:
    """Failure 1 of issue 26: the resource bundles stayed behind and every service crashed."""
    listing = run([DOCKER, "run", "--rm", "--entrypoint", "bash", "iap-pipeline:local", "-c",
                   "ls -d /usr/local/bin/*.resources; test ! -e /src && echo no-build-folder; pwd"])
    missing = [b for b in BUNDLES if f"/usr/local/bin/{b}" not in listing]
    check(not missing and "no-build-folder" in listing,
          f"the image carries {', '.join(BUNDLES)} beside /usr/local/bin/iap, and not the build folder "
          f"(/src) whose absolute path a binary would otherwise fall back to")
    for service in ["orders-1", "orders-2", "verifier"] if stack.cluster else ["orders", "verifier"]:
        for cid in stack.containers(service):
            logs = subprocess.run([DOCKER, "logs", cid], capture_output=True, text=True).stderr
            check("could not load resource bundle" not in logs and stack.inspect(cid)["RestartCount"] == 0,
                  f"{service} {cid[:12]} started once, from /data (not the build's folder), no bundle error")
    # The console renders its templates (the Console bundle) through a published port.
    # Both files serve the console and the admin routes on their own port (127.0.0.1 only).
    port = "admin"
    status, body = http("GET", f"{stack.url(port)}/admin/login")
    css_status, css = http("GET", f"{stack.url(port)}/admin/static/console.css")
    check(status == 200 and "sign in" in str(body).lower() and css_status == 200 and "{" in str(css),
          f"the console's sign-in page and stylesheet come from its bundle ({status}, {css_status})")


def check_demo(stack: Stack) -> None:
    cid = stack.container("demo")
    rc = run([DOCKER, "wait", cid], timeout=180).strip()
    logs = subprocess.run([DOCKER, "logs", cid], capture_output=True, text=True)
    check(rc == "0" and '"credited"' in logs.stdout,
          f"the demo client's purchase was credited (exit {rc}: {logs.stderr.strip().splitlines()[-1:]})")


def check_prometheus(stack: Stack, expected: dict[str, int], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, body = http("GET", stack.url("prometheus") + "/api/v1/targets")
        targets = body.get("data", {}).get("activeTargets", []) if isinstance(body, dict) else []
        jobs: dict[str, int] = {}
        down = []
        for t in targets:
            job = t["labels"].get("job", "?")
            jobs[job] = jobs.get(job, 0) + 1
            if t.get("health") != "up":
                down.append(f"{job} {t['labels'].get('instance')}: {t.get('health')} {t.get('lastError', '')}")
        if not down and jobs == expected:
            check(True, f"Prometheus scrapes every target and each is up: {jobs}")
            return
        if time.monotonic() > deadline:
            raise CheckFailed(f"Prometheus targets {jobs} (expected {expected}), down: {down}")
        time.sleep(3)


# ---------------------------------------------------------------------------------------------
# The single-node file


def test_single(stack: Stack, count: int) -> None:
    with Stage("services healthy, image and demo"):
        stack.wait_healthy()
        check_image(stack)
        check_demo(stack)
    with Stage("scale to 3 verifiers"):
        stack.up("--scale", "verifier=3", demo=False)
        stack.wait_healthy()
        verifiers = stack.containers("verifier")
        check(len(verifiers) == 3, "three verifier containers")
        before = {v: ops_metric(stack, v, "iap_verifications_total") for v in verifiers}
    with Stage(f"{count} purchases through the intake's published port"):
        purchases = send_purchases(stack, "bulk", count)
        wait_all_credited(stack, purchases)
        after = {v: ops_metric(stack, v, "iap_verifications_total") for v in verifiers}
        consumed = {v[:12]: int(after[v] - before[v]) for v in verifiers}
        check(all(n > 0 for n in consumed.values()) and sum(consumed.values()) >= count,
              f"the three verifiers shared the queue (verifications per verifier: {consumed})")
    with Stage("docker kill of the order service mid-stream, then up again"):
        orders = stack.container("orders")

        def kill() -> None:
            run([DOCKER, "kill", orders])
            say("killed the order service's container")

        def restart() -> None:
            time.sleep(2)
            stack.up("--scale", "verifier=3", demo=False)
            say("docker-compose up again")

        purchases = send_purchases(stack, "kill-orders", max(30, count // 4), fault=kill, recover=restart, workers=4)
        stack.wait_healthy()
        check(any(p.failed_attempts for p in purchases), "uploads were refused while the order service was down")
        wait_all_credited(stack, purchases)
    with Stage("Prometheus targets"):
        check_prometheus(stack, {"orders": 1, "verifier": 3, "rabbitmq": 1})


# ---------------------------------------------------------------------------------------------
# The cluster file


def cluster_nodes(stack: Stack, node: str) -> dict:
    out = stack.exec(node, "rabbitmq-diagnostics", "-q", "cluster_status", "--formatter", "json")
    return json.loads(out)


def check_quorum_queues(stack: Stack) -> None:
    out = stack.exec("rabbitmq-1", "rabbitmqctl", "-q", "list_queues", "name", "type", "members", "online",
                     "--formatter", "json")
    queues = json.loads(out)
    quorum = [q for q in queues if q.get("type") == "quorum"]
    short = {q["name"]: (len(q.get("members") or []), len(q.get("online") or [])) for q in quorum
             if len(q.get("members") or []) != 3 or len(q.get("online") or []) != 3}
    check(len(quorum) >= 2 and not short,
          f"every quorum queue ({len(quorum)}: {', '.join(sorted(q['name'] for q in quorum))}) has three members, "
          f"all online" + (f"; short: {short}" if short else ""))


def test_cluster(stack: Stack, count: int) -> None:
    with Stage("services healthy, plugins, cluster, balancer, image, demo"):
        stack.wait_healthy(timeout=420)
        for n in (1, 2, 3):
            node = f"rabbitmq-{n}"
            # Failure 2: umask 077 left the plugin list unreadable to user rabbitmq.
            plugins = stack.exec(node, "cat", "/etc/rabbitmq/enabled_plugins", user="rabbitmq", check_rc=False)
            info = stack.inspect(stack.container(node))
            check("rabbitmq_prometheus" in plugins and info["RestartCount"] == 0,
                  f"{node}: user rabbitmq reads /etc/rabbitmq/enabled_plugins, the node started once")
            status = cluster_nodes(stack, node)
            check(sorted(status["running_nodes"]) == [f"rabbit@rabbitmq-{i}" for i in (1, 2, 3)],
                  f"{node} is in one cluster with the three nodes running")
        # Failure 4: a `ping` passed on a lone node; the health check must count the members.
        health = stack.inspect(stack.container("rabbitmq-1"))["Config"]["Healthcheck"]["Test"]
        lone = run([DOCKER, "run", "-d", "--network", "none", "--hostname", "lone", "rabbitmq:3.10-management"]).strip()
        try:
            deadline = time.monotonic() + 90
            while subprocess.run([DOCKER, "exec", lone, "rabbitmq-diagnostics", "-q", "check_running"],
                                 capture_output=True).returncode != 0:
                if time.monotonic() > deadline:
                    raise CheckFailed("the lone RabbitMQ node did not start")
                time.sleep(2)
            command = health[1:] if health[0] == "CMD" else ["sh", "-c", health[1]]
            rc = subprocess.run([DOCKER, "exec", lone, *command], capture_output=True).returncode
            check(rc != 0, "the nodes' health check fails on a running node that is alone in its cluster")
        finally:
            subprocess.run([DOCKER, "rm", "-f", "-v", lone], capture_output=True)
        # Failure 3: HAProxy exited where its maxconn needed more files than the container may open.
        cfg = (COMPOSE_DIR / "haproxy" / "haproxy.cfg").read_text()
        maxconn = int(re.search(r"^\s*maxconn\s+(\d+)", cfg, re.M).group(1))
        limit = int(stack.exec("lb", "sh", "-c", "ulimit -n").strip())
        lb = stack.inspect(stack.container("lb"))
        check(lb["State"]["Status"] == "running" and lb["RestartCount"] == 0 and 2 * maxconn + 100 <= limit,
              f"HAProxy runs (started once) with maxconn {maxconn} under the container's open-file limit {limit}")
        check_image(stack)
        check_demo(stack)
        check_quorum_queues(stack)
        for n in (1, 2):
            env = stack.inspect(stack.container(f"orders-{n}"))["Config"]["Env"]
            check(any(e.startswith("IAP_DATABASE_URL=postgres://") for e in env),
                  f"orders-{n} runs on PostgreSQL behind the balancer")
    with Stage("purchases through HAProxy; docker kill of the RabbitMQ node in use mid-stream"):
        # list_connections shows the whole cluster's connections: count them by the node in their pid.
        out = stack.exec("rabbitmq-1", "rabbitmqctl", "-q", "list_connections", "pid")
        connections = {n: out.count(f"rabbit@rabbitmq-{n}.") for n in (1, 2, 3)}
        victim = max(connections, key=lambda n: connections[n])
        check(connections[victim] > 0, f"AMQP connections per node: {connections}; the services use rabbitmq-{victim}")
        victim_id = stack.container(f"rabbitmq-{victim}")

        def kill_node() -> None:
            run([DOCKER, "kill", victim_id])
            say(f"killed rabbitmq-{victim}")

        # Half the single-node file's count: the point is the failover, not the volume.
        purchases = send_purchases(stack, "kill-node", max(50, count // 2), fault=kill_node)
        wait_all_credited(stack, purchases, timeout=300)
    with Stage(f"rabbitmq-{victim} restarts and rejoins"):
        if stack.inspect(victim_id)["State"]["Status"] != "running":
            run([DOCKER, "start", victim_id])
        stack.wait_healthy(timeout=240)
        for n in (1, 2, 3):
            status = cluster_nodes(stack, f"rabbitmq-{n}")
            check(len(status["running_nodes"]) == 3, f"rabbitmq-{n} sees three running nodes")
        deadline = time.monotonic() + 60
        while True:
            try:
                check_quorum_queues(stack)
                break
            except CheckFailed:
                if time.monotonic() > deadline:
                    raise
                time.sleep(3)
    with Stage("Prometheus targets"):
        check_prometheus(stack, {"orders": 2, "verifier": len(stack.containers("verifier")), "rabbitmq": 3, "lb": 1})


# ---------------------------------------------------------------------------------------------


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 2 or args[0] not in ("up", "test", "down"):
        sys.exit(__doc__)
    action, state_dir = args[0], Path(args[1])
    cluster, build = "--cluster" in args, "--no-build" not in args
    count = int(os.environ.get("IAP_COMPOSE_PURCHASES", "200"))
    if action == "down":
        for c in (False, True):
            stack = Stack(state_dir, c)
            if stack.env_file.exists():
                with Stage(f"docker-compose -f {stack.file} down -v"):
                    stack.down()
        return
    stack = Stack(state_dir, cluster)
    try:
        stack.write_settings()
        if build:
            with Stage("build iap-pipeline:local from compose/Dockerfile (docker-compose build)"):
                stack.build()
        with Stage(f"docker-compose -f {stack.file} up"):
            stack.up()
        if action == "up":
            stack.wait_healthy(timeout=420)
            ports = stack.state["ports"]
            print(f"\n{stack.file} is up (project {stack.project}):\n"
                  f"  API            http://127.0.0.1:{ports['http']}\n"
                  + f"  admin/console  http://127.0.0.1:{ports['admin']}/admin/\n"
                  + f"  fake App Store http://127.0.0.1:{ports['fake']}\n"
                  f"  Prometheus     http://127.0.0.1:{ports['prometheus']}\n"
                  f"  RabbitMQ UI    http://127.0.0.1:{ports['rabbitmq_ui']}\n"
                  f"  settings       {stack.env_file} (user tokens: IAP_AUTH_HS256_SECRET)\n"
                  f"  stop with      scripts/dev compose down\n")
            return
        (test_cluster if cluster else test_single)(stack, count)
        say(f"compose test of {stack.file} passed in {time.monotonic() - T0:.0f}s")
        failed = 0
    except (CheckFailed, subprocess.TimeoutExpired) as err:
        say(f"FAILED: {err}")
        if action == "test":
            for line in run([DOCKER, "ps", "-a", "--format", "{{.Names}} {{.Status}}"], check_rc=False).splitlines():
                print(f"    {line}", file=sys.stderr)
        failed = 1
    finally:
        if action == "test":
            with Stage(f"docker-compose -f {stack.file} down -v"):
                stack.down()
    if action == "test":
        print(f"compose: {PASSED[0]} passed, {failed} failed", flush=True)
    sys.exit(failed)


if __name__ == "__main__":
    main()
