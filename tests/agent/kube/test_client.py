"""The API client's answers to what is not an API server's answer: a 2xx whose body is not JSON (a proxy's page, a
cut body) is a KubeError in words, never a decoding exception."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from aiohttp import web

from agent.kube.client import KubeClient, KubeError


async def test_a_success_whose_body_is_not_json_is_a_kube_error(tmp_path: Path) -> None:
    async def page(_: web.Request) -> web.Response:
        return web.Response(status=200, text="<html>a proxy's welcome page</html>", content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    kube = await KubeClient.connect(kubeconfig)
    try:
        with pytest.raises(KubeError, match=r"^get resourceclaim default/c: the answer is not JSON$") as raised:
            await kube.get_claim("default", "c")
        assert raised.value.status == 200
    finally:
        await kube.close()
        await runner.cleanup()
