"""The admin dashboard, served by the gateway under ``/admin`` (``admin_ui.extension``).

Server-rendered Jinja2 pages over the admin services (``gateway.admin.service``, the batch tier's
service): every write goes through the code the admin API uses, in its unit of work. Read-only views
query the ledger and the router's replica registry. Modules: ``session`` (login, cookie, CSRF), ``web``
(rendering), ``usage_data`` (chart series and CSV), ``views/`` (one router per page area).
"""
