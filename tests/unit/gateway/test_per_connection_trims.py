"""What the gateway's mitmproxy skips per connection gives what mitmproxy's own way gives: a hook's arguments
(airlock/gateway/proxy_connections.py `hook_args`), an option's value (airlock/gateway/startup/mitm.py
`read_options_once`), and the layer of a connection (`LayerChoice`: mitmproxy's choice asked for by the addon only
where it keeps it, never inside one of its tunnels)."""

from __future__ import annotations

import copy
from typing import Any

from addon_env import client, client_hello, connect_flow, gateway, next_layer, sni
from mitmproxy import options
from mitmproxy.master import Master
from mitmproxy.proxy import layer, layers, mode_specs
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HttpConnectHook, HttpRequestHeadersHook
from mitmproxy.proxy.server_hooks import ClientConnectedHook, ServerConnectHook, ServerConnectionHookData
from mitmproxy.test import taddons, tflow

from airlock.gateway.proxy_connections import Hooks, hook_args
from airlock.gateway.startup.mitm import LayerChoice
from airlock.proxy.httplayer import HttpLayer
from airlock.proxy.tunnels import MeteredTunnel


def test_a_hooks_arguments_are_mitmproxys() -> None:
    flow = tflow.tflow()
    data = ServerConnectionHookData(tflow.tserver_conn(), tflow.tclient_conn())
    nextlayer = layer.NextLayer(Context(tflow.tclient_conn(), options.Options()))
    hooks = [ClientConnectedHook(tflow.tclient_conn()), HttpConnectHook(flow), HttpRequestHeadersHook(flow),
             ServerConnectHook(data), layer.NextLayerHook(nextlayer)]  # fmt: skip
    for hook in hooks * 2:  # found once per class, then from what was found
        ours, theirs = hook_args(hook), hook.args()
        assert len(ours) == len(theirs) == 1 and ours[0] is theirs[0]


def test_an_options_value_is_mitmproxys_and_a_mutable_one_a_copy_of_its_own() -> None:
    opts = options.Options()
    mutable = 0
    for name, option in opts._options.items():
        value = getattr(opts, name)
        assert value == copy.deepcopy(option._default) and type(value) is type(option._default), name
        if isinstance(value, list | dict | set):
            mutable += 1
            assert value is not option._default and value is not getattr(opts, name), name
    assert mutable  # ignore_hosts, mode, ...: each read gives a copy nobody else holds
    opts.update(ignore_hosts=["a"])  # type: ignore[no-untyped-call]
    hosts = opts.ignore_hosts
    hosts.append("b")
    assert opts.ignore_hosts == ["a"]


async def test_mitmproxys_layer_choice_is_no_hook_of_its_own() -> None:
    class Addon:
        def next_layer(self, nextlayer: Any) -> None:
            pass

    addon = Addon()
    m = Master(options.Options())
    m.addons.add(LayerChoice(), addon)  # type: ignore[no-untyped-call]
    assert Hooks(m.addons).of("next_layer") == (addon.next_layer,)


async def test_inside_a_tunnel_mitmproxys_layer_choice_is_not_made() -> None:
    gw, asked = gateway(), []
    gw.transparent.mitmproxy_layers = asked.append
    flow = connect_flow("allowed.test", 443)
    await gw.http.http_connect(flow)
    nextlayer = next_layer(flow.client_conn, "allowed.test", 443, client_hello(sni(b"allowed.test")))
    await gw.transparent.next_layer(nextlayer)
    assert isinstance(nextlayer.layer, MeteredTunnel) and asked == []
    waiting = next_layer(flow.client_conn, "allowed.test", 443, client_hello(sni(b"allowed.test"))[:20])
    await gw.transparent.next_layer(waiting)
    assert waiting.layer is None and asked == []  # the rest of the ClientHello is waited for, as before


async def test_a_connections_first_layer_is_mitmproxys_choice_made_the_gateways() -> None:
    gw, choice = gateway(), LayerChoice()
    gw.transparent.mitmproxy_layers = choice.choose
    with taddons.context(choice) as tctx:
        context = Context(client(), tctx.options)
        context.client.proxy_mode = mode_specs.ProxyMode.parse("regular")
        context.layers = [modes.HttpProxy(context)]
        nextlayer = layer.NextLayer(context)
        await gw.transparent.next_layer(nextlayer)
    assert isinstance(nextlayer.layer, HttpLayer) and nextlayer.layer.mode is layers.http.HTTPMode.regular
    assert gw.shared.clients[context.client.id].denied is None


def test_a_connection_is_ignored_as_mitmproxys_options_say() -> None:
    choice, context = LayerChoice(), Context(client(), options.Options())
    context.server.address = ("allowed.test", 443)
    assert choice._ignore_connection(context, b"", b"") is False  # no host filter set: no option read
    with taddons.context(choice) as tctx:
        tctx.configure(choice, ignore_hosts=["^allowed\\.test"])
        assert choice._ignore_connection(context, b"", b"") is True  # mitmproxy's own check, with the filter
        tctx.configure(choice, ignore_hosts=[])
        assert choice._ignore_connection(context, b"", b"") is False
