print("iap")
