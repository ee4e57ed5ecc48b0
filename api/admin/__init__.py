"""The admin dashboard (`/admin`): usage charts, live sessions and runs, the fleet, tenants'
limits and keys, and billing to Stripe, for holders of an admin-scope API key.

`pages` renders the HTML (with `render`), `forms` takes the forms that change something,
`api` serves the JSON and CSV the pages draw from, `auth` decides who may see either,
`cookies` signs the session cookie and derives its CSRF token, and `usage`, `overview` and
`billing` read the rows. None of it is in the OpenAPI document.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from api.admin import api, forms, pages
from api.admin.auth import LoginRequired
from api.admin.render import HEADERS


def install(app: FastAPI) -> None:
    """Mount the dashboard's routes, and send a page's visitor without a session to log in."""
    app.include_router(pages.router)
    app.include_router(forms.router)
    app.include_router(api.router)

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, _: LoginRequired) -> Response:
        login = f"{str(request.scope.get('root_path', '')).rstrip('/')}/admin/login"
        if request.headers.get("HX-Request") == "true":
            # A table's refresh after the session ended: htmx loads the login page whole,
            # instead of swapping it into the table.
            return Response(status_code=204, headers=HEADERS | {"HX-Redirect": login})
        return RedirectResponse(login, status_code=303, headers=HEADERS)
