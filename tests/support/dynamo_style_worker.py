"""A worker written exactly as for NVIDIA Dynamo, with only the import changed."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from dynamo_zmq.runtime import Context, DistributedRuntime, dynamo_endpoint, dynamo_worker


class Request(BaseModel):
    text: str
    delay: float = 0.0


class Response(BaseModel):
    word: str


class Handler:
    def __init__(self, runtime: DistributedRuntime) -> None:
        self.runtime = runtime

    @dynamo_endpoint(Request, Response)
    async def generate(self, request: Request, context: Context):
        for word in request.text.split():
            if context.is_stopped():
                return
            yield Response(word=word)
            await asyncio.sleep(request.delay)


@dynamo_worker()
async def worker(runtime: DistributedRuntime) -> None:
    component = runtime.namespace(NAMESPACE).component("backend")
    await component.create_service()
    endpoint = component.endpoint("generate")
    handler = Handler(runtime)
    print(f"READY {runtime.address} {runtime.instance_id:x}", flush=True)
    await endpoint.serve_endpoint(handler.generate)


if __name__ == "__main__":
    import sys

    NAMESPACE = sys.argv[1]
    asyncio.run(worker())
