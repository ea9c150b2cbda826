"""The console's home page is the admin's index with the fleet above the tables
(``console.views.home`` fills it in)."""

from django.contrib import admin

admin.site.index_template = "console/home.html"
