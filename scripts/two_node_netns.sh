#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair, with addresses only
# on those veths (node A 10.200.0.1/24 on veth0, node B 10.200.0.2/24 on veth1; each also has its
# own loopback), and a 2-node distrain run across them: one torchrun per namespace, c10d
# rendezvous hosted on node A. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2.
#
#   sudo scripts/two_node_netns.sh up                  # create the namespaces
#   sudo scripts/two_node_netns.sh run [--nproc-per-node P] [--port PORT] -- <distrain train args>
#   sudo scripts/two_node_netns.sh down                # remove them (and anything still running in them)
#
# `run` sets the namespaces up (replacing stale ones of the same id), starts
#   python -m distrain.distributed.agent --nnodes 2 --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint 10.200.0.1:PORT \
#            --local-addr <node's address> [--rdzv-conf is_host=true on node A] \
#            -m distrain.cli train --num-nodes 2 --devices P <distrain train args>
# in each (torchrun, as distrain's agent: its stores listen on the node's address, not on every interface),
# prefixes their output with [node-a]/[node-b], stops the other node as soon as one
# fails, and always tears the namespaces down. Its exit code is the first failing node's (0 if
# both succeed). Example:
#
#   sudo scripts/two_node_netns.sh run -- --max-steps 20 --output-dir runs/two-nodes
#
# What it takes for gloo to work across the namespaces (torch 2.13):
# - GLOO_SOCKET_IFNAME=<the node's veth>: otherwise gloo binds to the address the hostname
#   resolves to (127.0.0.1 here), which the other node cannot reach;
# - --local-addr: the address torchrun advertises for this node;
# - --rdzv-conf is_host=true on node A: the rendezvous store runs there (it cannot tell from
#   10.200.0.1 alone that the address is its own);
# - an absolute path to python for `ip netns exec` (a bare `python`, e.g. a pyenv shim, did not
#   start the right interpreter in trial runs).
#
# Run it from the repository root (or with distrain installed). sudo resets PATH: name your
# interpreter, e.g. `sudo PYTHON="$(command -v python)" scripts/two_node_netns.sh run -- ...`.
#
# Environment: DISTRAIN_NETNS_ID (default 0) makes the names unique (namespaces dtn<ID>a and
# dtn<ID>b), so concurrent or stale runs never collide; PYTHON (default: python3 on PATH);
# RDZV_JOIN_TIMEOUT (seconds, default 120): how long a node waits for the other to join;
# DISTRAIN_COMMAND (default train): the distrain command to run, e.g. `doctor` (its args after --);
# NETNS_GLOO_SOCKET_IFNAME: both nodes' GLOO_SOCKET_IFNAME instead of their veths (empty: unset
# it), to see the failure the right interface prevents; `distrain doctor` explains it:
#   sudo NETNS_GLOO_SOCKET_IFNAME= DISTRAIN_COMMAND=doctor scripts/two_node_netns.sh run
set -euo pipefail

ID="${DISTRAIN_NETNS_ID:-0}"
NS_A="dtn${ID}a"
NS_B="dtn${ID}b"
ADDR_A=10.200.0.1
ADDR_B=10.200.0.2
IF_A=veth0
IF_B=veth1
pid_a=""  # the two torchruns (global: the EXIT trap runs after run() returned)
pid_b=""

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}

down() {
    local ns pids
    for ns in "$NS_A" "$NS_B"; do
        if ip netns list | grep -qw "^$ns"; then
            pids="$(ip netns pids "$ns" 2>/dev/null || true)"
            [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
            ip netns del "$ns"
        fi
    done
}

up() {
    down  # a stale pair of the same id (a run that was killed) must not get in the way
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    # both ends are created directly inside their namespaces: nothing appears on the host
    ip link add "$IF_A" netns "$NS_A" type veth peer name "$IF_B" netns "$NS_B"
    ip -n "$NS_A" addr add "$ADDR_A/24" dev "$IF_A"
    ip -n "$NS_B" addr add "$ADDR_B/24" dev "$IF_B"
    for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
    ip -n "$NS_A" link set "$IF_A" up
    ip -n "$NS_B" link set "$IF_B" up
    echo "two_node_netns: $NS_A ($ADDR_A on $IF_A) <-> $NS_B ($ADDR_B on $IF_B)"
}

run() {
    local nproc=2 port=29400
    while [ $# -gt 0 ]; do
        case "$1" in
            --nproc-per-node) nproc="$2"; shift 2 ;;
            --port) port="$2"; shift 2 ;;
            --) shift; break ;;
            *) usage ;;
        esac
    done
    local python
    python="$(command -v "${PYTHON:-python3}")"
    python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
    local rdzv=(--nnodes 2 --nproc-per-node "$nproc" --rdzv-backend c10d --rdzv-endpoint "$ADDR_A:$port"
                --rdzv-id "distrain-netns-$ID")
    local train=(-m distrain.cli "${DISTRAIN_COMMAND:-train}" --num-nodes 2 --devices "$nproc" "$@")
    # no launcher variables from the calling shell: torchrun sets them
    local clean=(env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT -u NODE_RANK)

    local ifname_a=(GLOO_SOCKET_IFNAME="$IF_A") ifname_b=(GLOO_SOCKET_IFNAME="$IF_B")
    if [ -n "${NETNS_GLOO_SOCKET_IFNAME+set}" ]; then  # to see the failure the right interface prevents
        ifname_a=(GLOO_SOCKET_IFNAME="$NETNS_GLOO_SOCKET_IFNAME")
        [ -z "$NETNS_GLOO_SOCKET_IFNAME" ] && ifname_a=(-u GLOO_SOCKET_IFNAME)
        ifname_b=("${ifname_a[@]}")
    fi

    up
    trap 'kill $pid_a $pid_b 2>/dev/null || true; down' EXIT
    trap 'exit 130' INT TERM
    ip netns exec "$NS_A" "${clean[@]}" "${ifname_a[@]}" "$python" -m distrain.distributed.agent "${rdzv[@]}" \
        --rdzv-conf "is_host=true,join_timeout=${RDZV_JOIN_TIMEOUT:-120}" --local-addr "$ADDR_A" "${train[@]}" \
        > >(sed -u 's/^/[node-a] /') 2>&1 &
    pid_a=$!
    ip netns exec "$NS_B" "${clean[@]}" "${ifname_b[@]}" "$python" -m distrain.distributed.agent "${rdzv[@]}" \
        --rdzv-conf "join_timeout=${RDZV_JOIN_TIMEOUT:-120}" --local-addr "$ADDR_B" "${train[@]}" \
        > >(sed -u 's/^/[node-b] /') 2>&1 &
    pid_b=$!

    # The first node to finish decides: if it failed, the other would wait for it until a timeout.
    while kill -0 "$pid_a" 2>/dev/null && kill -0 "$pid_b" 2>/dev/null; do sleep 0.5; done
    local first=$pid_a second=$pid_b code=0 other=0
    kill -0 "$pid_a" 2>/dev/null && { first=$pid_b; second=$pid_a; }
    wait "$first" || code=$?
    if [ "$code" -ne 0 ]; then
        echo "two_node_netns: a node failed (exit $code); stopping the other" >&2
        kill "$second" 2>/dev/null || true
    fi
    wait "$second" || other=$?
    return $(( code != 0 ? code : other ))
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac
