"""The console's home page is the admin's index with the fleet above the tables
(``console.views.home`` fills it in)."""

from django.contrib import admin

admin.site.index_template = "console/home.html"
# Single sign-on beside (or instead of) the password form (console.sso).
admin.site.login_template = "console/login.html"
