"""The activator: stands in for a DynamoWorker's pods while none is ready (scale to zero).

It keeps the model in discovery with the cards the pods last published, is the worker
Service's endpoint (through the `<worker>-activator` EndpointSlice), holds requests
(bounded, timed), wakes the DynamoWorker through the autoscaler's reading of its held
requests, forwards each to the first ready pod that serves its model, and steps out of
discovery once pods serve. It steps in as soon as the operator marks that slice scaled to
zero, while the last pod still serves (the operator lets that pod go once the activator's
endpoint is ready). It imports `dynamo.runtime` and `dynamo.common`, never `dynamo.engines`.

Modules: `config` (environment), `pods` (the ready pods, a pod-source interface),
`kube_source` (the watches), `cards` (card capture), `presence` (when and what to publish),
`kube_presence` (publishing it), `hold` (bounded, timed waiting), `http_proxy` (the HTTP
port), `tcp_relay` (upstream's TCP request plane), `system` (probes, metrics, card files),
`metrics`, `app` (wiring), `cli` (the `dynamo-activator` command).
"""
