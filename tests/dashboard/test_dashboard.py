"""The web dashboard in a real browser against the real server: it fills its tables, follows a
queue's depth without a reload, draws its charts, and keeps the console clean."""

import json
import pathlib
import urllib.error
import urllib.request

from pymemcache.client.base import Client

REPO = pathlib.Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "target" / "dashboard.png"
QUEUE = "dash-jobs"
DEPTH_CELL = f'tr[data-queue="{QUEUE}"] td[data-field="messages"]'


def http(method, url, body=None):
    """(status, headers, body bytes) of one request; error statuses are answers, not exceptions."""
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def offer(petrel, n):
    client = Client(petrel.memcache, connect_timeout=5, timeout=10)
    try:
        for _ in range(n):
            assert client.set(QUEUE, b"x", noreply=False)
    finally:
        client.close()


def test_dashboard_follows_a_queue(petrel, browser):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    status, _, body = http("PUT", f"{petrel.http}/api/v1/queues/{QUEUE}", b'{"durable": true}')
    assert status == 201, body
    offer(petrel, 3)

    def depth_is(text):
        def check(driver):
            return driver.find_element(By.CSS_SELECTOR, DEPTH_CELL).text == text

        return check

    def wait_for_depth(text):
        WebDriverWait(browser, 10, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(
            depth_is(text), f"the dashboard never showed {text} messages in {QUEUE}"
        )

    try:
        browser.get(petrel.http + "/")
        wait_for_depth("3")
        offer(petrel, 2)
        wait_for_depth("5")  # by its own polling: no reload

        version = json.loads(http("GET", f"{petrel.http}/api/v1/server")[2])["version"]
        assert browser.find_element(By.ID, "version").text == version
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-queue="{QUEUE}"]')
        assert row.find_element(By.CSS_SELECTOR, 'td[data-field="durable"]').text == "yes"
        for chart in ("chart-rates", "chart-depth"):
            size = browser.find_element(By.ID, chart).size
            assert size["width"] > 0 and size["height"] > 0, (chart, size)
        assert not browser.find_element(By.ID, "status").is_displayed(), browser.find_element(By.ID, "status").text
    finally:
        SCREENSHOT.parent.mkdir(exist_ok=True)
        browser.save_screenshot(str(SCREENSHOT))

    problems = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not problems, "the browser console reported:\n" + "\n".join(f"{e['level']}: {e['message']}" for e in problems)


def test_dashboard_assets(petrel):
    status, headers, body = http("GET", petrel.http + "/")
    assert status == 200
    assert headers.get_content_type() == "text/html", headers["Content-Type"]
    assert b"dashboard.js" in body

    status, headers, _ = http("GET", petrel.http + "/dashboard.js")
    assert status == 200
    assert headers.get_content_type() in ("text/javascript", "application/javascript"), headers["Content-Type"]

    status, headers, _ = http("GET", petrel.http + "/dashboard.css")
    assert status == 200
    assert headers.get_content_type() == "text/css", headers["Content-Type"]

    status, headers, body = http("GET", petrel.http + "/nope.js")
    assert status == 404
    assert headers.get_content_type() == "application/json", headers["Content-Type"]
    assert json.loads(body)["status"] == 404
