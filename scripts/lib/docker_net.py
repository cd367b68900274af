#!/usr/bin/env python3
"""Record and restore what a Docker engine changes in the host's network (python3 stdlib only).

  docker_net.py save FILE     record iptables (every table), the network links and ip_forward
  docker_net.py restore FILE  undo what appeared since: delete the iptables rules and chains
                              that were not there (Docker's DOCKER* chains and the rules that
                              jump to them or masquerade its subnets), delete the links that
                              were not there (docker0, br-*, veth*), and put ip_forward back

Only differences are undone: rules, chains and links that existed before are left alone.
"""
import json
import subprocess
import sys
from collections import Counter

IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"
# Chains of the kernel's tables: never deleted, only their policy put back (dockerd sets the
# FORWARD policy to DROP). A table that was not loaded before had every policy ACCEPT.
BUILT_IN = {"INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING"}
# Links an engine makes; others that appeared meanwhile (someone else's) are left alone.
DOCKER_LINK_PREFIXES = ("docker", "br-", "veth")


def iptables() -> dict[str, dict]:
    """{table: {"chains": [...], "policies": {chain: policy}, "rules": ["-A CHAIN ...", ...]}}
    from iptables-save."""
    out = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    tables: dict[str, dict[str, list[str]]] = {}
    table = None
    for line in out.splitlines():
        if line.startswith("*"):
            table = line[1:]
            tables[table] = {"chains": [], "policies": {}, "rules": []}
        elif table and line.startswith(":"):
            chain, policy = line[1:].split()[:2]
            tables[table]["chains"].append(chain)
            if chain in BUILT_IN:
                tables[table]["policies"][chain] = policy
        elif table and line.startswith("-A "):
            tables[table]["rules"].append(line)
    return tables


def links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]


def save(path: str) -> None:
    with open(IP_FORWARD) as f:
        forward = f.read().strip()
    with open(path, "w") as f:
        json.dump({"iptables": iptables(), "links": links(), "ip_forward": forward}, f)


def restore(path: str) -> None:
    with open(path) as f:
        before = json.load(f)
    failures = []
    after = iptables()
    for table, now in after.items():
        old = before["iptables"].get(table, {"chains": [], "policies": {}, "rules": []})
        extra = Counter(now["rules"]) - Counter(old["rules"])
        for rule, count in extra.items():
            for _ in range(count):
                args = ["iptables", "-t", table, "-D"] + rule.split()[1:]
                # iptables-save quotes comments; the shell-free split keeps them whole enough
                # for Docker's rules, which carry none.
                if subprocess.run(args, capture_output=True).returncode != 0:
                    failures.append(" ".join(args))
        for chain, policy in now["policies"].items():
            wanted = old.get("policies", {}).get(chain, "ACCEPT")
            if policy != wanted and subprocess.run(["iptables", "-t", table, "-P", chain, wanted],
                                                   capture_output=True).returncode != 0:
                failures.append(f"iptables -t {table} -P {chain} {wanted}")
        for chain in [c for c in now["chains"] if c not in old["chains"] and c not in BUILT_IN]:
            subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True)
            if subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True).returncode != 0:
                failures.append(f"iptables -t {table} -X {chain}")
    # Tables that were not loaded before (iptables-nft makes them on first use) and are now
    # empty again: deleted, where nft is installed.
    for table in after:
        if table not in before["iptables"] and not iptables().get(table, {}).get("rules"):
            if subprocess.run(["which", "nft"], capture_output=True).returncode == 0:
                subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True)
    for link in links():
        if link not in before["links"] and link.startswith(DOCKER_LINK_PREFIXES):
            if subprocess.run(["ip", "link", "delete", link], capture_output=True).returncode != 0:
                failures.append(f"ip link delete {link}")
    with open(IP_FORWARD, "w") as f:
        f.write(before["ip_forward"] + "\n")
    left = [t for t, now in iptables().items()
            for c in now["chains"] if c.startswith("DOCKER")
            and c not in before["iptables"].get(t, {}).get("chains", [])]
    if failures or left:
        sys.exit("could not restore the network: " + "; ".join(failures + [f"chain {c} left" for c in left]))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "restore":
        restore(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
