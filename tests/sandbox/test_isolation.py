"""Bubblewrap isolation: no network out with network="none", writes land only in the workspace."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import pytest

from sandbox import SandboxSpec

pytestmark = [pytest.mark.real]


@pytest.fixture
async def host_tcp_server():
    """A TCP server on the host's 127.0.0.1 that answers 'pong'; yields its port."""
    async def handle(reader, writer):
        writer.write(b"pong\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


CONNECT = "exec 3<>/dev/tcp/127.0.0.1/{port} && head -n1 <&3"


async def test_network_none_cannot_reach_host_services(bwrap_runtime, host_tcp_server):
    h = await bwrap_runtime.start(SandboxSpec(network="none"))
    r = await h.bash(CONNECT.format(port=host_tcp_server), timeout_s=10)
    assert r.exit_code != 0 and "pong" not in r.output
    r = await h.bash("grep -c : /proc/net/dev; exec 3<>/dev/tcp/1.1.1.1/53", timeout_s=10)
    assert r.output.startswith("1\n")  # only the private loopback interface
    assert r.exit_code != 0
    await h.close()


async def test_network_host_reaches_host_services_control(bwrap_runtime, host_tcp_server):
    # The control for the test above: the same probe succeeds when the network is shared.
    h = await bwrap_runtime.start(SandboxSpec(network="host"))
    r = await h.bash(CONNECT.format(port=host_tcp_server), timeout_s=10)
    assert r.output == "pong\n" and r.exit_code == 0
    await h.close()


async def test_writes_outside_workspace_fail_and_tmp_is_private(sandbox, short_tmp):
    r = await sandbox.bash("for p in /etc/x /usr/x /work/x /home/x; do touch $p 2>/dev/null && echo wrote $p; done; "
                           "echo private > /tmp/t.txt && echo in-ws > w.txt && echo done")
    assert r.output == "done\n"
    assert open(os.path.join(sandbox.workspace, "w.txt")).read() == "in-ws\n"
    assert not os.path.exists("/etc/x")
    # /tmp inside is a fresh tmpfs: the host's /tmp is not visible and nothing written there reaches the host.
    host_file = os.path.join(short_tmp, "host-only.txt")
    open(host_file, "w").write("host")
    r = await sandbox.bash(f"cat /tmp/t.txt; test -e {host_file} && echo host-tmp-visible")
    assert r.output == "private\n"
    assert not os.path.exists("/tmp/t.txt") or open("/tmp/t.txt").read() != "private\n"


async def test_loopback_sandboxes_get_distinct_addresses_released_on_close(bwrap_runtime, runtime_options):
    a = await bwrap_runtime.start(SandboxSpec(network="loopback"))
    b = await bwrap_runtime.start(SandboxSpec(network="loopback"))
    assert a.address and b.address and a.address != b.address
    assert a.address.startswith("127.")
    assert (await a.bash("echo $PRORL_SANDBOX_ADDRESS")).output == f"{a.address}\n"
    # The address is usable by the sandbox's services and reachable from the host.
    await a.bash(f"python3 -c \"import socket,time;s=socket.socket();s.bind(('{a.address}',0));s.listen();"
                 "open('port','w').write(str(s.getsockname()[1]));c,_=s.accept();c.send(b'hi');time.sleep(1)\" "
                 "> /dev/null 2>&1 &")
    for _ in range(100):
        if os.path.exists(os.path.join(a.workspace, "port")) and open(os.path.join(a.workspace, "port")).read():
            break
        await asyncio.sleep(0.05)
    port = int(open(os.path.join(a.workspace, "port")).read())
    with socket.create_connection((a.address, port), timeout=5) as s:
        assert s.recv(2) == b"hi"
    lease_dir = runtime_options["loopback_dir"]
    assert sorted(os.listdir(lease_dir)) == sorted([a.address, b.address])
    await a.close()
    await b.close()
    assert os.listdir(lease_dir) == []


async def test_spec_from_dict_and_field_overrides(bwrap_runtime):
    h = await bwrap_runtime.start({"env": {"TASK": "from-dict"}, "limits": {"max_processes": 50}}, workdir="/task")
    r = await h.bash('echo "$TASK"; pwd; ulimit -u')
    assert r.output == "from-dict\n/task\n50\n"
    assert h.spec.limits.max_processes == 50
    await h.close()
    with pytest.raises(ValueError, match="network"):
        await bwrap_runtime.start(network="internet")


@pytest.fixture(scope="module")
def tiny_rootfs(tmp_path_factory):
    """A minimal root file system: bash and a few tools, hard-linked from the host (no download), plus a marker
    in /etc. The project and its interpreter are bound in by the runtime itself."""
    root = tmp_path_factory.mktemp("rootfs")
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "lib").mkdir()
    (root / "etc").mkdir()
    (root / "etc" / "marker").write_text("from the image\n")
    for tool in ("bash", "sh", "cat", "stty", "ls", "touch"):
        src = os.path.join("/usr/bin", tool)
        if os.path.islink(src):
            os.symlink(os.readlink(src), root / "usr" / "bin" / tool)
        elif os.path.exists(src):
            os.link(os.path.realpath(src), root / "usr" / "bin" / tool)
    multiarch = "/usr/lib/x86_64-linux-gnu"
    if not os.path.isdir(multiarch):
        pytest.skip("the tiny rootfs is assembled from a Debian x86_64 layout")
    subprocess.run(["cp", "-al", multiarch, str(root / "usr" / "lib")], check=True)
    if os.path.isdir("/usr/lib64"):
        subprocess.run(["cp", "-al", "/usr/lib64", str(root / "usr")], check=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{name}", root / name)
    return str(root)


async def test_rootfs_image_replaces_the_host_root(bwrap_runtime, tiny_rootfs):
    h = await bwrap_runtime.start(SandboxSpec(image=tiny_rootfs, workdir="/srv/task"))
    r = await h.bash("cat /etc/marker; pwd; touch /etc/x 2>/dev/null || echo ro")
    assert r.output == "from the image\n/srv/task\nro\n"
    assert (await h.bash("test -e /etc/debian_version && echo host-etc-visible")).exit_code == 1
    assert (await h.ipython("import os; os.getcwd()")).text == "'/srv/task'\n"
    await h.close()


async def test_user_namespace_mode_isolates_network_and_maps_fakeroot(runtime_options):
    # run_as=False takes the path an unprivileged server takes (bwrap --unshare-all, user namespace) even here.
    from sandbox import make_runtime

    rt = make_runtime("bubblewrap", run_as=False, **runtime_options)
    try:
        h = await rt.start(SandboxSpec(network="none", fakeroot=True))
        r = await h.bash("id -u; grep -c : /proc/net/dev; echo x > f && cat f")
        assert r.output == "0\n1\nx\n"
        assert (await h.ipython("2*21")).text == "42\n"
        h2 = await rt.start(SandboxSpec(network="host"))
        host_interfaces = sum(":" in line for line in open("/proc/net/dev"))
        assert int((await h2.bash("grep -c : /proc/net/dev")).output) == host_interfaces
    finally:
        await rt.close_all()


async def test_a_sandbox_cannot_read_the_nodes_cgroups_but_its_tools_still_work(bwrap_runtime):
    # Red team F5: the read-only /sys showed /sys/fs/cgroup, every prorl sandbox's memory use among it (an info
    # leak about co-tenants' jobs). A second sandbox stands for the co-tenant.
    a = await bwrap_runtime.start(SandboxSpec(network="none"))
    b = await bwrap_runtime.start(SandboxSpec(network="none"))
    try:
        r = await a.bash("ls /sys/fs/cgroup; find /sys -name 'memory.*' 2>/dev/null | head -3; "
                         "find /sys -name '*prorl*' -o -name '*sb-*' 2>/dev/null | head -3", timeout_s=20)
        assert "No such file or directory" in r.output and "memory." not in r.output
        assert "prorl" not in r.output and b.sandbox_id not in r.output
        # what needs /sys still works: nproc and os.cpu_count (CPU topology), python, bash, git
        r = await a.bash("nproc; python -c 'import os; print(os.cpu_count())'; "
                         "git init -q g && git -C g -c user.name=t -c user.email=t@t commit -q --allow-empty -m x "
                         "&& git -C g log --oneline | wc -l", timeout_s=30)
        assert r.output.split() == [str(len(os.sched_getaffinity(0))), str(os.cpu_count()), "1"], r.output
    finally:
        await a.close()
        await b.close()
