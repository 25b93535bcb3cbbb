"""Sandbox backends (netns, docker) and the kernel fence that makes the gateway their only route."""

import re

# Sandbox ids name namespaces, interfaces (15 characters at most with their prefix) and nft tables.
SANDBOX_ID = re.compile(r"[a-z0-9]{1,12}")


def proxy_environment(gateway_ip: str, proxy_port: int, broker_port: int | None = None) -> dict[str, str]:
    """What a sandboxed command needs to find the gateway: proxy variables, and the broker if there is one."""
    proxy = f"http://{gateway_ip}:{proxy_port}"
    env = {name: proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    # The broker lives on the gateway's own address: talk to it directly (the fence allows its port).
    env["NO_PROXY"] = env["no_proxy"] = f"localhost,127.0.0.1,::1,{gateway_ip}"
    if broker_port:
        env["AIRLOCK_BROKER_URL"] = f"http://{gateway_ip}:{broker_port}"
    return env
