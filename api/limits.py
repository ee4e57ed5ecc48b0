"""Request body size limits, enforced while the body streams in (Content-Length can lie)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import for_scope
from core.errors import ErrorCode


class BodySizeLimit:
    """Answers 413 once a request body exceeds `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (
            f"request body exceeds this server's limit of {self.max_bytes} bytes; split the batch "
            "into smaller requests"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await for_scope(scope, 413, ErrorCode.PAYLOAD_TOO_LARGE, self._message())(
                    scope, receive, send
                )
                return
        seen = 0
        responded = False  # once our 413 is out, the app's own response is dropped

        async def limited_receive() -> Message:
            nonlocal seen, responded
            message = await receive()
            if message["type"] == "http.request" and not responded:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    responded = True
                    await for_scope(scope, 413, ErrorCode.PAYLOAD_TOO_LARGE, self._message())(
                        scope, receive, send
                    )
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not responded:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)
