"""GET /: the web page (`web/index.html`), one static file with its script and style inline: no
build step, nothing fetched from another origin. Its script calls the app's own routes
(/v1/models, /v1/chat/completions streamed, /cluster/state) relative to where the page is
served, so it works under a Serve route prefix and on `orbital serve`'s port alike.

The page shows model output, which is untrusted text: the script only ever sets `textContent`,
and the Content-Security-Policy allows the page's own inline script and style (by their hashes)
and requests to its own origin, nothing else."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from pathlib import Path

from fastapi.responses import HTMLResponse

PAGE = Path(__file__).with_name("web") / "index.html"


def _hashes(html: str, tag: str) -> str:
    """CSP source expressions for the bodies of the page's inline `<tag>` elements."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    digests = (base64.b64encode(hashlib.sha256(b.encode("utf-8")).digest()).decode("ascii") for b in bodies)
    return " ".join(f"'sha256-{d}'" for d in digests)


@cache
def _page() -> tuple[str, dict[str, str]]:
    html = PAGE.read_text(encoding="utf-8")
    csp = "; ".join(
        (
            "default-src 'none'",
            f"script-src {_hashes(html, 'script')}",
            f"style-src {_hashes(html, 'style')}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    headers = {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html, headers


def web_page() -> HTMLResponse:
    """The page with its security headers (read from the package once per process)."""
    html, headers = _page()
    return HTMLResponse(html, headers=headers)
