#!/usr/bin/env python3
"""Drives customer service's console in headless Chromium (Debian's chromium and
chromium-driver, through Selenium) against a live pipeline with the fake App Store.

Run by Tests/IAPTests/ConsoleBrowserTests.swift, which starts the pipeline, makes a held
purchase and a dead-lettered upload, and passes their ids. Each scenario saves a screenshot
of its final page under --out. Prints one JSON line per check; exits 1 if any failed.
"""
import argparse
import json
import os
import sys
import time
import urllib.parse
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

FAILED = []
PENDING = []


def check(name, ok, detail=""):
    # Held until the scenario's run ends: a run the browser broke is discarded whole.
    PENDING.append(json.dumps({"check": name, "ok": bool(ok), "detail": detail}))
    if not ok:
        FAILED.append(name)
    return ok


def flush_checks():
    for line in PENDING:
        print(line, flush=True)
    PENDING.clear()


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1366,900"):
        options.add_argument(flag)
    # Starting Chromium can fail on a machine busy with the rest of the suite (an empty
    # WebDriverException): a few tries, bounded, before the scenario counts as failed.
    for attempt in range(3):
        try:
            driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
            break
        except WebDriverException:
            if attempt == 2:
                raise
            time.sleep(2)
    driver.implicitly_wait(2)
    return driver


def sign_in(driver, base, token, name):
    driver.get(base + "/admin/login")
    driver.find_element(By.ID, "name").send_keys(name)
    driver.find_element(By.ID, "token").send_keys(token)
    submit(driver, driver.find_element(By.CSS_SELECTOR, "form button[type=submit]"))


def search(driver, base, term):
    driver.get(base + "/admin/")
    box = driver.find_element(By.ID, "q")
    box.clear()
    box.send_keys(term)
    submit(driver, driver.find_element(By.CSS_SELECTOR, "form[role=search] button"))


def submit(driver, button):
    """Clicks a submit button and waits until the next page replaced this one."""
    page = driver.find_element(By.TAG_NAME, "html")
    button.click()
    WebDriverWait(driver, 10).until(expected_conditions.staleness_of(page))


def text(driver):
    return driver.find_element(By.TAG_NAME, "body").text


def shoot(driver, out, name):
    path = os.path.join(out, name + ".png")
    # The whole page, as tall as it is, at the laptop's width.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1366, max(900, min(int(height) + 40, 4000)))
    driver.save_screenshot(path)
    driver.set_window_size(1366, 900)
    print(json.dumps({"screenshot": path}), flush=True)


def user_path(user):
    """The console's page of a user, the id percent-encoded as the console's links do."""
    return "/admin/users/" + urllib.parse.quote(user, safe="")


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def viewer_is_refused(args):
    driver = browser()
    try:
        sign_in(driver, args.admin_url, args.viewer_token, "Vera (support)")
        check("viewer signed in", "Signed in as Vera (support) (viewer)" in text(driver), driver.current_url)
        search(driver, args.admin_url, args.order_id)
        check(
            "order id search goes to the customer",
            driver.current_url.endswith(user_path(args.held_user)), driver.current_url)
        timeline = driver.find_element(By.ID, "timeline").text
        check(
            "timeline shows the held purchase",
            args.held_transaction in timeline and "held (unknown_product)" in timeline, timeline[:400])
        check("viewer sees no grant form", not driver.find_elements(By.ID, "grant-" + args.held_transaction))
        # Post the grant anyway, with this session's own CSRF token (from the sign-out form).
        csrf = driver.find_element(By.CSS_SELECTOR, "form[action='/admin/logout'] input[name=csrf]").get_attribute("value")
        driver.execute_script(
            """
            const form = document.createElement('form');
            form.method = 'post'; form.action = '/admin/actions/grant';
            for (const [name, value] of Object.entries(arguments[0])) {
                const input = document.createElement('input');
                input.type = 'hidden'; input.name = name; input.value = value; form.appendChild(input);
            }
            document.body.appendChild(form); form.submit();
            """,
            {"csrf": csrf, "transactionId": args.held_transaction, "userId": args.held_user,
             "productId": args.product, "reason": "viewer tries", "key": "viewer-try"})
        time.sleep(0.5)
        heading = driver.find_element(By.ID, "message-heading").text
        check("viewer's grant is refused with 403", "403" in heading and "read-only" in heading, heading)
        shoot(driver, args.out, "console-viewer-refused")
    finally:
        driver.quit()


def operator_grants(args):
    driver = browser()
    try:
        sign_in(driver, args.admin_url, args.operator_token, "Olga (operator)")
        search(driver, args.admin_url, args.order_id)
        check("operator lands on the customer", driver.current_url.endswith(user_path(args.held_user)), driver.current_url)
        form = driver.find_element(By.ID, "grant-" + args.held_transaction)
        Select(form.find_element(By.TAG_NAME, "select")).select_by_value(args.product)
        form.find_element(By.NAME, "reason").send_keys("Customer paid; product missing from the catalog (ticket 4711)")
        submit(driver, form.find_element(By.TAG_NAME, "button"))
        flash = driver.find_element(By.ID, "flash").text
        check("grant confirmed", "Granted " + args.product in flash, flash)
        user = urllib.parse.quote(args.held_user, safe="")
        grants = get_json(f"{args.intake_url}/v1/users/{user}/grants")["grants"]
        check(
            "the app sees the grant",
            any(g["transactionId"] == args.held_transaction and g["state"] == "active" for g in grants), json.dumps(grants))
        timeline = driver.find_element(By.ID, "timeline").text
        check("the grant is audited with its reason", "ticket 4711" in timeline and "Olga (operator)" in timeline, timeline[-400:])
        # A note, kept in the audit log.
        driver.find_element(By.ID, "note-text").send_keys("Customer wrote on 2026-11-23: paid, got nothing. Granted by hand.")
        submit(driver, driver.find_element(By.CSS_SELECTOR, "#note-form button"))
        check("note added", "Note added" in driver.find_element(By.ID, "flash").text)
        shoot(driver, args.out, "console-customer")
    finally:
        driver.quit()


def operator_extends_renewal(args):
    # One subscription's renewal date, then every active subscriber of its product, at Apple
    # (the fake); the subscription line shows what it renews to once Apple's word is in.
    driver = browser()
    try:
        sign_in(driver, args.admin_url, args.operator_token, "Olga (operator)")
        driver.get(args.admin_url + user_path(args.subscriber))
        timeline = driver.find_element(By.ID, "timeline").text
        # A second run of this scenario (after the browser failed) must not extend again: Apple
        # allows two extensions of a subscription in 365 days, and the first run's extension and
        # every-subscriber extension were both real. The audit says whether it went through.
        if not ("incident 77" in timeline and "renewal date extended" in timeline):
            form = driver.find_element(By.ID, "extend-" + args.subscription)
            form.find_element(By.NAME, "days").send_keys("5")
            Select(form.find_element(By.TAG_NAME, "select")).select_by_value("3")
            form.find_element(By.NAME, "reason").send_keys("Streaming outage of 28 November (incident 77)")
            submit(driver, form.find_element(By.TAG_NAME, "button"))
            flash = driver.find_element(By.ID, "flash").text
            check("renewal date extended", f"Apple extended subscription {args.subscription} by 5 days" in flash, flash)
            timeline = driver.find_element(By.ID, "timeline").text
        check("the extension is audited with its reason", "incident 77" in timeline and "renewal date extended" in timeline,
              timeline[-400:])
        renews = ""
        for _ in range(40):
            driver.get(args.admin_url + user_path(args.subscriber))
            renews = driver.find_element(By.ID, "subs-heading").find_element(By.XPATH, "..").text
            if "renews" in renews:
                break
            time.sleep(0.25)
        check("the subscription line says what it renews to", "renews" in renews and "USD" in renews, renews)
        driver.get(args.admin_url + "/admin/")
        form = driver.find_element(By.ID, "mass-extend")
        form.find_element(By.NAME, "productId").send_keys(args.subscription_product)
        form.find_element(By.NAME, "days").send_keys("2")
        form.find_element(By.NAME, "reason").send_keys("Outage of 28 November, every subscriber (incident 77)")
        submit(driver, form.find_element(By.TAG_NAME, "button"))
        flash = driver.find_element(By.ID, "flash").text
        check("every active subscriber asked", "Apple took request" in flash and args.subscription_product in flash, flash)
        shoot(driver, args.out, "console-mass-extend")
    finally:
        driver.quit()


def form_without_csrf_is_refused(args):
    driver = browser()
    try:
        sign_in(driver, args.admin_url, args.operator_token, "Olga (operator)")
        driver.get(args.admin_url + user_path(args.held_user))
        driver.execute_script("document.querySelector('#note-form input[name=csrf]').remove()")
        driver.find_element(By.ID, "note-text").send_keys("This note must not be stored")
        submit(driver, driver.find_element(By.CSS_SELECTOR, "#note-form button"))
        heading = driver.find_element(By.ID, "message-heading").text
        check("form without CSRF token refused with 403", "403" in heading and "refused" in heading, heading)
        shoot(driver, args.out, "console-csrf-refused")
        driver.get(args.admin_url + user_path(args.held_user))
        check("nothing was stored", "must not be stored" not in driver.find_element(By.ID, "timeline").text)
    finally:
        driver.quit()


def dead_letter_is_redriven(args):
    driver = browser()
    try:
        sign_in(driver, args.admin_url, args.operator_token, "Olga (operator)")
        driver.get(args.admin_url + "/admin/")
        section = driver.find_element(By.ID, "dead-heading").find_element(By.XPATH, "..")
        check("dead letter listed", args.dead_submission in section.text, section.text[:400])
        form = driver.find_element(By.ID, "redrive-verify")
        form.find_element(By.NAME, "reason").send_keys("Message dead-lettered by a purge; redrive")
        submit(driver, form.find_element(By.TAG_NAME, "button"))
        flash = driver.find_element(By.ID, "flash").text
        check("redrive confirmed", "Redrove 1 message" in flash, flash)
        state = ""
        deadline = time.time() + 30
        while time.time() < deadline:
            state = get_json(f"{args.intake_url}/v1/receipts/{args.dead_submission}?userId={args.dead_user}")["state"]
            if state == "credited":
                break
            time.sleep(0.3)
        check("redriven upload ends credited", state == "credited", state)
        driver.get(args.admin_url + user_path(args.dead_user))
        timeline = driver.find_element(By.ID, "timeline").text
        check("timeline shows the credit", "credited" in timeline and "Credited" in timeline, timeline[-400:])
        shoot(driver, args.out, "console-redriven")
    finally:
        driver.quit()


def hostile_text_stays_text(args):
    """Ids that would break out of an attribute or a text node if escaped per grapheme
    cluster render as text; a login link whose next page is markup does not navigate away;
    a form's CSRF token does not drive another action."""
    driver = browser()
    try:
        hostile_next = '"\u0301><meta http-equiv=refresh content="0;url=http://127.0.0.1:9/">'
        driver.get(args.admin_url + "/admin/login?next=" + urllib.parse.quote(hostile_next, safe=""))
        time.sleep(1.5)
        check("the login link stays on the login page", driver.current_url.startswith(args.admin_url + "/admin/login"),
              driver.current_url)
        check("no meta refresh was injected", not driver.find_elements(By.CSS_SELECTOR, "meta[http-equiv]"))
        driver.find_element(By.ID, "name").send_keys("Olga (operator)")
        driver.find_element(By.ID, "token").send_keys(args.operator_token)
        submit(driver, driver.find_element(By.CSS_SELECTOR, "form button[type=submit]"))
        check("signing in from it stays in the console", driver.current_url.startswith(args.admin_url + "/admin/"),
              driver.current_url)

        driver.get(args.admin_url + "/admin/")
        check("no injected element on the front page",
              not driver.find_elements(By.ID, "injected") and not driver.find_elements(By.ID, "injected-product"))
        body = text(driver)
        check("the hostile product id shows as text", "<b id=injected-product>" in body, body[:600])
        check("the hostile user id shows as text", "formaction=/admin/actions/revoke" in body, body[:600])

        driver.get(args.admin_url + user_path(args.hostile_user))
        check("no injected button on the customer page", not driver.find_elements(By.ID, "injected"))
        shown = driver.find_element(By.ID, "customer-id").text
        check("the customer's id is shown as it is", shown == args.hostile_user, repr(shown))
        note_csrf = driver.find_element(By.CSS_SELECTOR, "#note-form input[name=csrf]").get_attribute("value")
        driver.execute_script(
            """
            const form = document.createElement('form');
            form.method = 'post'; form.action = '/admin/actions/revoke';
            for (const [name, value] of Object.entries(arguments[0])) {
                const input = document.createElement('input');
                input.type = 'hidden'; input.name = name; input.value = value; form.appendChild(input);
            }
            document.body.appendChild(form); form.submit();
            """,
            {"csrf": note_csrf, "transactionId": args.hostile_transaction, "reason": "injected", "key": "inj-1",
             "back": "/admin/"})
        time.sleep(0.5)
        heading = driver.find_element(By.ID, "message-heading").text
        check("the note form's token does not revoke", "403" in heading and "refused" in heading, heading)
        shoot(driver, args.out, "console-hostile-text")
    finally:
        driver.quit()


def main():
    parser = argparse.ArgumentParser()
    for name in ("admin-url", "intake-url", "operator-token", "viewer-token", "order-id", "held-user",
                 "held-transaction", "product", "dead-user", "dead-submission", "out", "hostile-user",
                 "hostile-product", "hostile-transaction", "subscriber", "subscription", "subscription-product"):
        parser.add_argument("--" + name, required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for scenario in (hostile_text_stays_text, viewer_is_refused, operator_grants, operator_extends_renewal,
                     form_without_csrf_is_refused, dead_letter_is_redriven):
        # The browser itself can fail on a machine busy with the rest of the suite (an empty
        # WebDriverException, from chromedriver rather than from the page): such a scenario
        # runs once more from the start, and only its second run counts.
        for attempt in range(2):
            failed_before = len(FAILED)
            try:
                scenario(args)
            except WebDriverException as error:
                if attempt == 0:
                    del FAILED[failed_before:]
                    PENDING.clear()
                    print(json.dumps({"retry": scenario.__name__, "after": repr(error)}), flush=True)
                    continue
                check(scenario.__name__, False, repr(error))
            except Exception as error:  # a missing element, an answer that is not the page
                check(scenario.__name__, False, repr(error))
            flush_checks()
            break
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
