"""Seeded generator of shopper requests with gold answers.

Every attribute is rendered by one of several *phrasing families* (``"sz 10"``,
``"size 10"``, ``"in a 10"``...). Each value pool and each family list is split
in two: the ``seen`` part is all that ``train`` ever uses; ``dev`` and ``test``
draw mostly from the ``held`` part, so their accuracy measures generalisation to
unseen words and values, not recall of training strings.

Each request carries ``meta.families``: the phrasing families it used, so tests
(and error analysis) can check coverage family by family.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from .data import Request, Turn
from .policies import support_reply
from .schema import SearchParams, SupportTopic, canonical_dict, canonical_json

Split = Literal["train", "dev", "test"]
SPLIT_SEEDS = {"train": 1, "dev": 2, "test": 3}


@dataclass(frozen=True)
class Pool:
    """Values of one kind, split into what training sees and what it never sees."""

    seen: tuple
    held: tuple

    def pick(self, rng: random.Random, split: Split, p_held: float = 0.6):
        if split != "train" and self.held and rng.random() < p_held:
            return rng.choice(self.held)
        return rng.choice(self.seen)


# --- catalogue ---------------------------------------------------------------
# product -> category; held-out products still name their kind plainly.
PRODUCTS: dict[str, Pool] = {
    "shoes": Pool(("running shoes", "trail running shoes", "sneakers", "hiking boots", "sandals",
                   "loafers", "ankle boots", "basketball shoes", "slippers", "high heels", "clogs",
                   "chelsea boots", "espadrilles", "snow boots", "cleats", "ballet flats", "work boots", "platform sneakers", "dress shoes", "slip-on shoes", "water shoes", "boat shoes", "wedge sandals", "golf shoes", "climbing shoes", "mary janes"),
                  ("rain boots", "tennis shoes", "flip flops", "walking shoes")),
    "clothing": Pool(("t-shirt", "hoodie", "jeans", "rain jacket", "dress", "sweater", "leggings",
                      "winter coat", "polo shirt", "shorts", "pajamas", "swimsuit", "blazer", "skirt",
                      "flannel shirt", "joggers", "tank top", "parka", "overalls", "socks", "bomber jacket", "trench coat", "cargo pants", "sweatpants", "graphic tee", "button-down shirt", "maxi dress", "sports bra", "windbreaker", "turtleneck", "crop top", "tracksuit", "board shorts", "bucket hat", "beanie", "scarf", "baseball cap"),
                     ("cardigan", "puffer vest", "chinos", "denim jacket")),
    "electronics": Pool(("wireless headphones", "earbuds", "laptop", "smartwatch", "bluetooth speaker",
                         "phone case", "gaming mouse", "monitor", "tablet", "usb-c charger", "soundbar",
                         "hdmi cable", "fitness tracker", "portable ssd", "router", "noise cancelling headphones", "gaming headset", "wireless mouse", "external hard drive", "smart speaker", "action camera", "drawing tablet", "car charger", "wifi extender", "ring light", "usb hub", "smart plug", "dash cam"),
                        ("mechanical keyboard", "webcam", "power bank", "e-reader")),
    "home": Pool(("coffee maker", "desk lamp", "bed sheets", "throw pillow", "cookware set",
                  "air fryer", "vacuum cleaner", "duvet cover", "kettle", "toaster", "rug", "curtains",
                  "frying pan", "candle", "stand mixer", "rice cooker", "memory foam pillow", "shower curtain", "bath mat", "knife set", "cutting board", "floor lamp", "wall clock", "laundry basket", "weighted blanket", "space heater", "french press", "toaster oven", "picture frame"),
                 ("blender", "bath towels", "table lamp", "dinnerware set")),
    "beauty": Pool(("moisturizer", "lipstick", "shampoo", "perfume", "sunscreen", "mascara", "body lotion",
                    "eyeliner", "hair dryer", "face wash", "lip balm", "night cream", "eye cream", "dry shampoo", "hair straightener", "curling iron", "makeup brushes", "setting spray", "foundation", "concealer", "body wash", "beard oil", "hand cream"),
                   ("face serum", "conditioner", "nail polish")),
    "sports": Pool(("yoga mat", "dumbbells", "tennis racket", "bike helmet", "water bottle",
                    "soccer ball", "resistance bands", "running belt",
                    "foam roller", "ski goggles", "basketball", "kettlebell", "pull-up bar", "exercise bike", "boxing gloves", "swim goggles", "hiking poles", "ab roller", "badminton set", "table tennis paddle", "sleeping bag", "knee sleeves"),
                   ("jump rope", "camping tent", "golf balls")),
    "toys": Pool(("lego set", "board game", "jigsaw puzzle", "plush toy", "toy car", "action figure",
                  "teddy bear", "train set", "rc car", "card game", "stuffed animal", "remote control helicopter", "play kitchen", "marble run", "science kit", "toy robot", "wooden puzzle", "water gun", "bath toys", "magnetic tiles", "coloring book", "yo-yo"),
                 ("doll house", "kite", "building blocks")),
    "bags": Pool(("backpack", "tote bag", "duffel bag", "wallet", "suitcase", "messenger bag",
                  "handbag", "carry-on", "gym bag", "garment bag", "cosmetic bag", "travel backpack", "shoulder bag", "clutch", "briefcase", "diaper bag", "card holder", "weekender bag", "drawstring bag"),
                 ("crossbody bag", "laptop sleeve", "fanny pack")),
    "jewelry": Pool(("necklace", "earrings", "bracelet", "ring", "watch", "brooch", "chain",
                     "hoop earrings", "stud earrings", "charm bracelet", "engagement ring", "tennis bracelet", "signet ring", "choker", "nose ring", "bangle", "dangle earrings"),
                    ("anklet", "pendant", "cufflinks")),
    "grocery": Pool(("coffee beans", "green tea", "protein powder", "olive oil", "dark chocolate",
                     "oat milk", "peanut butter", "espresso pods", "maple syrup", "instant noodles", "almond butter", "sparkling water", "trail mix", "hot sauce", "ground coffee", "herbal tea", "energy bars", "rice crackers", "coconut water", "matcha powder", "dried mango", "balsamic vinegar"),
                    ("granola", "honey", "pasta sauce")),
}

BRANDS: dict[str, Pool] = {
    "shoes": Pool(("nike", "adidas", "new balance", "asics", "puma", "hoka", "brooks", "vans",
                   "converse", "skechers", "reebok", "salomon", "timberland",
                   "dr. martens", "crocs", "clarks", "mizuno", "fila", "keen", "ugg", "allbirds", "teva", "altra", "veja", "ecco", "sperry", "steve madden"), ("saucony", "merrell", "birkenstock", "on running")),
    "clothing": Pool(("levi's", "uniqlo", "zara", "h&m", "patagonia", "the north face", "gap",
                      "columbia", "ralph lauren", "tommy hilfiger", "calvin klein",
                      "mango", "champion", "wrangler", "old navy", "banana republic", "j.crew", "abercrombie", "hollister", "american eagle", "nautica", "guess", "superdry"), ("carhartt", "arc'teryx", "lululemon", "everlane")),
    "electronics": Pool(("sony", "bose", "apple", "samsung", "logitech", "jbl", "dell", "lenovo",
                         "anker", "lg", "microsoft", "hp",
                         "beats", "xiaomi", "canon", "google", "nintendo", "sandisk", "tp-link", "panasonic", "acer", "fitbit", "jabra", "skullcandy", "msi"), ("sennheiser", "razer", "asus", "garmin")),
    "home": Pool(("ikea", "keurig", "philips", "cuisinart", "dyson", "ninja", "kitchenaid", "smeg",
                  "tefal", "bosch", "oxo", "instant pot", "hamilton beach", "black+decker", "lodge", "zwilling", "pyrex", "corelle", "brabantia", "simplehuman", "west elm"),
                 ("breville", "le creuset", "shark")),
    "beauty": Pool(("loreal", "nivea", "maybelline", "cerave", "neutrogena", "garnier", "revlon",
                    "olay", "dior", "estee lauder", "mac", "fenty beauty", "la roche-posay", "aveeno", "eucerin", "bioderma", "nyx", "kiehl's", "pantene"),
                   ("the ordinary", "clinique", "dove")),
    "sports": Pool(("wilson", "under armour", "decathlon", "yeti", "manduka", "babolat", "mikasa",
                    "oakley", "gaiam", "coleman", "everlast", "bowflex", "camelbak", "speedo", "callaway", "titleist", "yonex"),
                   ("hydro flask", "spalding", "head")),
    "toys": Pool(("lego", "hasbro", "mattel", "melissa & doug", "hot wheels",
                   "vtech", "crayola", "nerf", "barbie", "hape", "little tikes", "schleich", "funko", "jellycat", "bandai", "k'nex"), ("ravensburger", "fisher-price", "playmobil")),
    "bags": Pool(("samsonite", "herschel", "fjallraven", "michael kors", "coach", "eastpak",
                  "jansport", "longchamp", "rimowa", "away", "kate spade", "vera bradley", "targus", "dakine", "eagle creek", "baggu", "deuter"),
                 ("osprey", "tumi", "kipling")),
    "jewelry": Pool(("pandora", "swarovski", "tiffany", "fossil", "cartier",
                     "citizen", "timex", "daniel wellington", "kendra scott", "alex and ani", "david yurman", "bulova", "tissot", "monica vinader", "thomas sabo"), ("casio", "seiko", "mejuri")),
    "grocery": Pool(("lavazza", "twinings", "optimum nutrition", "lindt", "nespresso",
                     "starbucks", "myprotein", "clif", "nature valley", "lipton", "bigelow", "nutella", "heinz", "kirkland", "folgers", "peet's", "tazo"),
                    ("illy", "ghirardelli", "barilla")),
}

# Misspellings shoppers really type; gold keeps the true name.
BRAND_TYPOS = {"adidas": "addidas", "skechers": "sketchers", "new balance": "new ballance",
               "nike": "nikee", "samsung": "samsng", "levi's": "levis", "loreal": "l'oreal",
               "saucony": "sauconi", "sennheiser": "senheiser", "patagonia": "patagucci"}

COLORS = Pool(("black", "white", "red", "blue", "green", "navy", "grey", "pink", "beige", "brown",
               "yellow", "purple", "orange", "tan", "khaki", "charcoal", "ivory",
               "lavender", "coral", "mint", "turquoise", "mustard", "magenta", "sky blue", "forest green", "rust", "peach", "lilac", "crimson", "indigo", "aqua", "fuchsia", "salmon", "taupe", "plum", "emerald", "sage", "cobalt", "mauve", "off-white", "light blue", "camel", "lime", "hot pink"), ("olive", "burgundy", "teal", "maroon", "cream", "silver"))
COLOR_ABBREV = {"black": "blk", "white": "wht", "grey": "gray", "navy": "nvy", "brown": "brn",
                "green": "grn", "blue": "blu", "burgundy": "wine", "maroon": "mrn", "olive": "olv",
                "pink": "pnk", "purple": "prpl", "yellow": "ylw", "orange": "orng",
                "charcoal": "chrcl", "lavender": "lvndr", "beige": "bge", "red": "rd"}

MATERIALS: dict[str, Pool] = {
    "shoes": Pool(("leather", "suede", "canvas", "mesh", "knit", "rubber", "patent leather", "nubuck", "synthetic", "gore-tex", "felt"), ("cork", "merino")),
    "clothing": Pool(("cotton", "wool", "polyester", "denim", "linen", "silk", "fleece", "nylon",
                          "corduroy", "bamboo", "rayon", "spandex", "satin", "chiffon", "velvet", "jersey", "modal"), ("cashmere", "merino")),
    "home": Pool(("cotton", "linen", "stainless steel", "bamboo", "ceramic", "wood",
                  "velvet", "wool", "marble", "porcelain", "copper", "microfiber", "jute", "teak"), ("cast iron", "glass")),
    "bags": Pool(("leather", "canvas", "nylon", "polyester", "suede", "denim", "straw", "mesh", "tweed", "recycled polyester"), ("vegan leather", "cork")),
    "jewelry": Pool(("silver", "gold", "stainless steel", "rose gold", "sterling silver", "pearl", "brass", "white gold"), ("titanium", "platinum")),
    "sports": Pool(("rubber", "foam", "stainless steel", "carbon fiber", "nylon", "neoprene", "silicone", "steel", "leather"), ("cork", "aluminum")),
}
COLORED = {"shoes", "clothing", "electronics", "home", "sports", "bags", "jewelry", "toys"}
AUDIENCES_FOR = {
    "shoes": ("men", "women", "kids", "boys", "girls", "unisex"),
    "clothing": ("men", "women", "kids", "boys", "girls", "baby", "unisex"),
    "toys": ("kids", "boys", "girls", "baby"),
    "jewelry": ("men", "women"),
    "beauty": ("men", "women"),
    "sports": ("men", "women", "kids", "unisex"),
    "bags": ("men", "women", "kids", "unisex"),
    "electronics": ("kids",),
}

AUDIENCE_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # audience: (seen forms, held forms); "{}" marks where the product goes
    "men": (("men's {}", "mens {}", "{} for men", "{} for guys", "male {}", "{} for a man", "{} for my dad", "{} (men)", "man's {}", "{} mens"), ("{} for him", "{} for my husband")),
    "women": (("women's {}", "womens {}", "{} for women", "female {}", "{} for my wife",
                "{} for a woman", "{} for my mom", "woman's {}", "{} (women)", "{} for my girlfriend", "{} womens"), ("ladies {}", "{} for her")),
    "kids": (("kids {}", "{} for kids", "kid's {}", "{} for little ones", "youth {}", "{} for a kid", "{} for my kids", "junior {}", "kids' {}"), ("children's {}",)),
    "boys": (("boys {}", "{} for boys", "boy's {}", "{} for a boy", "{} for my boy", "boys' {}", "{} for a young boy"), ("{} for my son",)),
    "girls": (("girls {}", "{} for girls", "girl's {}", "{} for a girl", "{} for my girl", "girls' {}", "{} for a young girl"), ("{} for my daughter",)),
    "baby": (("baby {}", "{} for a baby", "{} for babies", "newborn {}", "{} for my baby", "{} for a newborn", "babies {}"), ("infant {}", "{} for a toddler")),
    "unisex": (("unisex {}", "{} for men and women", "{} for anyone", "{} for both genders", "{} for everyone", "{} men or women"), ("gender-neutral {}",)),
}

SIZES = {
    "shoes": Pool(("7", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12", "40", "42", "44", "7.5", "39", "43", "5", "5.5", "6", "12.5", "14", "36", "37", "41", "46"),
                  ("6.5", "11.5", "13", "38", "45")),
    "clothing": Pool(("xs", "s", "m", "l", "xl", "xxl", "32x30", "34x32", "2xl", "32x32", "30x32", "xxs", "4xl", "28x30", "34x30", "36x32", "38x32"), ("3xl", "30x30", "36x34")),
}
SIZE_WORDS = {"s": "small", "m": "medium", "l": "large", "xs": "extra small", "xl": "extra large"}

CURRENCIES = {
    # code: (seen renderings, held renderings); {} is the amount
    "USD": (("${}", "{} dollars", "{} usd", "{} bucks", "usd {}", "$ {}", "{} dollar", "{}USD", "USD{}", "{} US dollars", "{}usd"), ("{}$", "US${}")),
    "EUR": (("€{}", "{} euros", "{} eur", "eur {}", "€ {}", "{} euro", "{}eur", "{} Euros", "€{} eur"), ("{}€", "EUR {}")),
    "GBP": (("£{}", "{} pounds", "{} gbp", "gbp {}", "£ {}", "{} pound", "{} british pounds", "{}gbp", "{} sterling", "£{} gbp"), ("{} quid", "GBP {}")),
    "CAD": (("C${}", "{} cad", "cad {}", "CA${}", "{} canadian", "CAD {}", "{} CAD", "cdn ${}", "{} cdn"), ("{} canadian dollars",)),
    "JPY": (("¥{}", "{} yen", "{}¥", "jpy {}", "{} japanese yen", "JPY{}", "{}yen", "¥ {}"), ("{} jpy",)),
}
CURRENCY_WEIGHTS = {"USD": 0.55, "EUR": 0.18, "GBP": 0.15, "CAD": 0.07, "JPY": 0.05}


def _fam(seen: tuple[str, ...], held: tuple[str, ...]) -> Pool:
    return Pool(seen, held)


# Phrasing families per attribute: name -> template (seen/held split by name).
PRICE_MAX = _fam(("under {p}", "below {p}", "less than {p}", "max {p}", "up to {p}", "at most {p}",
                  "maximum {p}", "{p} max", "not over {p}", "no higher than {p}", "within {p}",
                  "budget {p}", "{p} tops", "lower than {p}", "for less than {p}", "cap {p}", "price under {p}", "spend up to {p}", "{p} max budget", "under about {p}", "keep it under {p}", "max budget {p}", "at or below {p}", "shouldn't cost more than {p}", "i can spend {p}", "{p} limit"),
                 ("no more than {p}", "{p} or less", "cheaper than {p}", "<{p}"))
PRICE_MIN = _fam(("over {p}", "above {p}", "more than {p}", "at least {p}", "min {p}", "minimum {p}",
                  "{p} and up", "{p}+", "upwards of {p}", "{p} minimum", "not under {p}",
                  "higher than {p}", "from {p} up", "pricier than {p}", "{p} plus", "price over {p}", "beyond {p}", "exceeding {p}", "spend at least {p}", "nothing under {p}", "{p} at least", "north of {p}", "more expensive than {p}", "costing more than {p}", "a minimum of {p}"),
                 ("{p} or more", "starting at {p}", ">{p}"))
PRICE_RANGE = _fam(("between {a} and {b}", "{a}-{b}", "from {a} to {b}", "{a} - {b}", "price {a}-{b}",
                    "somewhere between {a} and {b}", "{a} up to {b}", "{a}–{b}", "{a} through {b}", "between {a} & {b}", "min {a} max {b}", "{a} min, {b} max", "at least {a} but under {b}"),
                   ("{a} to {b}", "in the {a}-{b} range"))
RATING = _fam(("{r}+ stars", "at least {r} stars", "rated {r} and up", "{r} stars or more",
               "{r} stars and up", "rating {r}+", "over {r} stars", "rated {r}+", "{r} star minimum",
               "rating at least {r}", "rated at least {r}", "{r}+ rating", "with {r}+ stars", "rated over {r}", "reviews {r}+", "{r} stars plus", "min rating {r}"),
              ("minimum {r} stars", "{r}* and above", "no less than {r} stars"))
SORTS = {
    "price_asc": (("cheapest first", "sort by price low to high", "lowest price first", "price low to high",
                   "cheapest on top", "order by price ascending", "low to high", "cheap first", "sort cheapest", "lowest first", "least expensive first"), ("budget first",)),
    "price_desc": (("most expensive first", "sort by price high to low", "price high to low",
                    "highest price first", "order by price descending", "expensive first", "high to low", "premium first", "most costly first"), ("priciest first",)),
    "rating": (("best rated first", "top rated", "sort by rating", "highest rated first",
                "best reviewed first", "sort by stars", "highest rated", "by rating", "top reviewed first", "best ratings first"), ("highest reviews first",)),
    "newest": (("newest first", "latest arrivals", "sort by newest", "new arrivals first",
                "most recent first", "latest first", "new first", "recently added", "fresh arrivals", "sort by date", "newest arrivals"), ("just released",)),
    "popularity": (("most popular", "best sellers first", "sort by popularity", "bestsellers first",
                    "most bought first", "popular first", "hot items first", "what's popular", "most viewed first", "top sellers"), ("trending first",)),
}
DELIVERY = {
    "free_shipping": (("free shipping", "with free shipping", "ships free", "free delivery",
                       "shipping included", "free ship", "free postage", "zero shipping fee", "shipping free", "free s&h"), ("no shipping cost",)),
    "same_day": (("same day delivery", "delivered today", "same-day shipping", "get it today", "same day shipping", "need it today", "same-day delivery"), ("arrives today",)),
    "next_day": (("next day delivery", "overnight shipping", "next-day shipping", "delivered tomorrow",
                  "1 day shipping", "next-day delivery", "overnight delivery", "one-day shipping"), ("arrives tomorrow", "by tomorrow")),
    "two_day": (("2-day shipping", "two day delivery", "2 day delivery", "two-day shipping",
                 "delivered in 2 days", "2day shipping", "2-day delivery", "ships in 2 days"), ("within 2 days",)),
    "pickup": (("in-store pickup", "pick up in store", "store pickup", "collect in store", "pickup in store", "in store pick up", "curbside pickup", "bopis"), ("click and collect",)),
}
IN_STOCK = _fam(("in stock", "in stock only", "available now", "in-stock", "currently available",
                 "only in-stock items", "only available items", "in stock now", "available today", "stocked only", "has stock", "instock", "only what's available", "items available now", "no backorders"), ("ready to ship", "not sold out"))
SIZE_FORMS = _fam(("size {s}", "sz {s}", "in size {s}", "sz{s}", "fits size {s}", "my size is {s}", "sized {s}", "size {s} please", "for size {s}", "(size {s})", "wearing size {s}"), ("in a {s}", "size:{s}", "{s} size"))
MATERIAL_FORMS = _fam(("{m}", "made of {m}", "in {m}", "made from {m}", "{m} material",
                       "out of {m}", "of {m}", "with {m} material", "{m} construction", "in a {m} finish", "material: {m}", "all {m}"), ("{m}-made", "crafted from {m}"))
EXCLUDE_FORMS = _fam(("no {b}", "not {b}", "except {b}", "anything but {b}", "without {b}",
                      "not from {b}", "exclude {b}", "nothing from {b}", "but not {b}", "no {b} please", "don't want {b}", "no {b} stuff", "minus {b}", "other than {b}", "not by {b}", "leave out {b}", "apart from {b}", "rather not {b}"),
                     ("avoid {b}", "skip {b}", "excluding {b}"))
INCLUDE_FORMS = _fam(("{b} {x}", "{x} from {b}", "{x} by {b}", "{x} made by {b}", "only {b} {x}",
                      "{x} ({b})", "{x} brand {b}", "{x} of {b}", "{x} - {b}", "{x} from brand {b}", "{x}, brand: {b}", "{x} (brand {b})", "{x} by the brand {b}"), ("{b}-brand {x}", "{x}, {b} only"))
OPENERS = _fam(("", "", "", "", "looking for ", "i want ", "show me ", "find ", "need ", "searching for ",
                "do you have ", "shopping for ", "help me find ", "i need ", "where can i get ", "want ", "please find ", "i'm looking for ", "looking to buy ", "search ", "show ", "need to buy ", "in the market for ", "recommend ", "any recs for ", "buy "),
               ("any ", "got any ", "hunting for ", "can you find me ", "i'd like "))
COMPARE_FORMS = _fam(("compare {a} and {b} {x}", "{a} vs {b} {x}", "{x}: {a} or {b}?", "{a} vs. {b} {x}",
                      "{a} or {b} {x}?", "difference between {a} and {b} {x}", "{a} compared to {b} {x}", "{a} or {b} for {x}", "should i get {a} or {b} {x}", "{a} {x} vs {b} {x}", "{a} against {b} {x}", "pros and cons {a} vs {b} {x}"),
                     ("which is better, {a} or {b} {x}", "{a} versus {b} for {x}"))

# Multi-turn refinements: (kind, seen phrasings, held phrasings)
REFINE_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cheaper": (("cheaper", "something cheaper", "show cheaper ones", "cheaper options?",
                 "anything less expensive?", "lower price please", "more affordable ones", "cheaper ones", "show me cheaper", "anything cheaper?"), ("too pricey, cheaper please",)),
    "color_swap": (("{c} instead", "what about in {c}", "show me {c} ones", "make it {c}",
                    "only {c} please", "in {c} instead", "switch to {c}", "{c} ones instead", "{c} version please", "change color to {c}"), ("got it in {c}?",)),
    "color_add": (("also in {c}", "{c} too", "add {c}", "{c} is fine too", "or {c}", "include {c}", "{c} also ok", "also show {c}", "plus {c}"), ("and {c} as well",)),
    "drop_brand": (("drop the brand filter", "any brand is fine", "brand doesn't matter",
                    "remove the brand", "no brand preference", "ignore the brand", "any brand", "clear the brand"), ("forget the brand",)),
    "exclude": (("no {b} please", "not {b}", "without {b}", "remove {b}", "not {b} though", "exclude {b}", "drop {b}", "no more {b}", "hide {b}"), ("take out {b}",)),
    "price": (("make it under {p}", "under {p} instead", "max {p}", "budget is {p}", "{p} max now", "lower budget to {p}", "can't spend more than {p}", "under {p} please", "cap it at {p}"), ("keep it below {p}",)),
    "size": (("size {s} instead", "in {s} please", "sz {s}", "need size {s}", "what about size {s}", "switch to size {s}", "make it size {s}", "{s} please"), ("actually sz {s}",)),
    "stock": (("only in stock", "just what's in stock", "in stock only please",
               "only available ones", "hide out of stock", "only available items", "in-stock ones", "available now only"), ("only ones that ship now",)),
    "sort": (("sort by rating", "best rated first", "top rated first", "highest rated please", "sort by stars", "best reviewed first", "show top rated", "by rating please"), ("order by reviews",)),
    "delivery": (("with free shipping", "free shipping only", "only free delivery",
                  "must ship free", "free delivery only", "ships free only", "free shipping please", "with free delivery"), ("no delivery fee",)),
}

SUPPORT_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "refund_window": (("how long do i have to return something?", "what is your refund policy?",
                       "can i get a refund after 2 weeks?", "return window?",
                       "can i return this?", "what's the return policy?", "refund window?", "how long are returns accepted?", "can i still return my order?"),
                      ("is there a time limit for refunds?", "how many days to send stuff back?")),
    "return_shipping": (("do i have to pay for return shipping?", "how do i send an item back?",
                         "is returning free?", "how do returns work?", "are returns free?", "cost to return an item?", "how do i ship a return?"), ("who pays postage on returns?", "return label?")),
    "order_status": (("where is my order {o}?", "status of order {o}", "has order {o} shipped yet?",
                      "tracking for {o}",
                      "where's {o}?", "track order {o}", "where's my package {o}", "order {o} status?", "when will {o} arrive?", "is {o} on the way?", "{o} tracking?"), ("any update on {o}?", "order {o} still not here")),
    "order_status_noid": (("where is my order?", "has my package shipped?", "where's my package?", "is my order on the way?", "tracking my order"), ("my stuff hasn't arrived",)),
    "payment_methods": (("what payment methods do you accept?", "can i pay with paypal?",
                         "do you take amex?", "can i pay by card?", "do you accept visa?", "can i use google pay?", "payment options?", "do you take mastercard?", "can i pay with klarna?"), ("is apple pay ok?", "which cards work?")),
    "shipping_times": (("how long does shipping take?", "when will my stuff arrive?",
                        "how fast is delivery?", "how many days for shipping?", "how long will delivery take?", "when does my order ship?", "shipping speed?", "how soon will it get here?"), ("standard shipping time?", "delivery estimate?")),
    "international": (("do you ship to canada?", "do you ship internationally?",
                       "can i order from germany?", "do you deliver to the uk?", "do you ship to australia?", "can you deliver to france?", "worldwide shipping?", "do you ship outside the us?"), ("ship abroad?", "international delivery time?")),
    "cancel_order": (("cancel order {o}", "how do i cancel order {o}?", "i want to cancel {o}",
                      "please cancel {o}", "cancel my order {o}", "i need to cancel {o}", "{o} cancel please"),
                     ("please stop order {o}", "can {o} still be cancelled?")),
    "cancel_order_noid": (("how do i cancel an order?", "can i cancel my order?", "how to cancel?", "i want to cancel my order"), ("undo my purchase",)),
    "warranty": (("is there a warranty on headphones?", "what warranty do electronics have?",
                  "my laptop broke, is it covered?", "how long is the warranty?", "does my tv have a warranty?", "warranty period?", "my phone stopped working, covered?", "how do i use the warranty?"), ("guarantee on gadgets?", "warranty claim?")),
}
SUPPORT_PREFIX = _fam(("", "", "hi, ", "hello, ", "quick question: ", "hey ", "hey there, ", "hi team, ", "question: ", "sorry, "), ("good morning, ", "excuse me, "))
SUPPORT_SUFFIX = _fam(("", "", " thanks", " thank you", " pls", " please", " ty", " thx"), (" cheers", " asap"))


@dataclass
class Rendered:
    text: str
    families: list[str] = field(default_factory=list)


def _pick_form(rng: random.Random, split: Split, seen: tuple[str, ...], held: tuple[str, ...],
               family: str, fams: list[str], p_held: float = 0.5) -> str:
    use_held = split != "train" and held and rng.random() < p_held
    form = rng.choice(held if use_held else seen)
    fams.append(f"{family}:{'held' if use_held else 'seen'}")
    return form


def _price_amount(rng: random.Random, currency: str) -> float:
    if currency == "JPY":
        return float(rng.choice([3000, 5000, 8000, 10000, 12000, 15000, 20000, 30000]))
    base = rng.choice([15, 20, 25, 30, 40, 50, 60, 75, 80, 100, 120, 150, 200, 250, 300, 500, 800, 1200])
    if base > 20 and rng.random() < 0.15:
        return round(base - 0.01, 2)  # "49.99"-style prices
    return float(base)


def _fmt_amount(rng: random.Random, amount: float, fams: list[str], split: Split) -> str:
    if amount >= 1000 and amount % 1000 == 0 and rng.random() < 0.4:
        fams.append("amount:k")
        return f"{int(amount // 1000)}k"
    if amount >= 1000 and amount % 100 == 0 and rng.random() < 0.2:
        fams.append("amount:k_decimal")
        return f"{amount / 1000:g}k"
    fams.append("amount:plain")
    return f"{amount:g}" if not amount.is_integer() else str(int(amount))


def _money(rng: random.Random, split: Split, amount: float, currency: str, fams: list[str]) -> str:
    seen, held = CURRENCIES[currency]
    form = _pick_form(rng, split, seen, held, f"currency_{currency}", fams)
    return form.format(_fmt_amount(rng, amount, fams, split))


def _typo(rng: random.Random, word: str) -> str:
    letters = [i for i, ch in enumerate(word) if ch in string.ascii_lowercase]
    if len(letters) < 4:
        return word
    i = rng.choice(letters[1:-1])
    op = rng.random()
    if op < 0.4:
        return word[:i] + word[i + 1:]  # drop
    if op < 0.8 and i + 1 < len(word):
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]  # swap
    return word[:i] + word[i] + word[i:]  # double


class Generator:
    def __init__(self, split: Split, seed: int | None = None):
        self.split = split
        self.rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + (seed or 0))

    # --- search -----------------------------------------------------------
    def _product(self) -> tuple[str, str]:
        category = self.rng.choice(list(PRODUCTS))
        return category, PRODUCTS[category].pick(self.rng, self.split)

    def search(self) -> tuple[str, SearchParams, list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        category, product = self._product()
        p: dict[str, Any] = {"intent": "search", "keywords": product, "category": category}
        product_text = product
        if rng.random() < 0.12:
            words = product_text.split()
            j = rng.randrange(len(words))
            words[j] = _typo(rng, words[j])
            if " ".join(words) != product_text:
                fams.append("typo:product")
            product_text = " ".join(words)

        # Pre-noun modifiers: colour, material.
        pre: list[str] = []
        if category in COLORED and rng.random() < 0.5:
            n = 2 if rng.random() < 0.15 else 1
            colors = []
            while len(colors) < n:
                c = COLORS.pick(rng, split)
                if c not in colors:
                    colors.append(c)
            p["colors"] = colors
            shown = []
            for c in colors:
                if c in COLOR_ABBREV and rng.random() < 0.3:
                    shown.append(COLOR_ABBREV[c])
                    fams.append("color:abbrev")
                else:
                    shown.append(c)
                    fams.append("color:plain")
            pre.append(" or ".join(shown) if len(shown) > 1 else shown[0])
        material_suffix = ""
        if category in MATERIALS and rng.random() < 0.3:
            m = MATERIALS[category].pick(rng, split)
            p["material"] = m
            form = _pick_form(rng, split, MATERIAL_FORMS.seen, MATERIAL_FORMS.held, "material", fams)
            if form == "{m}":
                pre.append(m)
            else:
                material_suffix = form.format(m=m)
        noun = " ".join(pre + [product_text])

        if category in AUDIENCES_FOR and rng.random() < 0.35:
            aud = rng.choice(AUDIENCES_FOR[category])
            p["audience"] = aud
            seen, held = AUDIENCE_FORMS[aud]
            noun = _pick_form(rng, split, seen, held, "audience", fams).format(noun)

        brand_pool = BRANDS[category]
        if rng.random() < 0.35:
            b = brand_pool.pick(rng, split)
            p["brands_include"] = [b]
            shown = b
            if b in BRAND_TYPOS and rng.random() < 0.25:
                shown = BRAND_TYPOS[b]
                fams.append("typo:brand")
            form = _pick_form(rng, split, INCLUDE_FORMS.seen, INCLUDE_FORMS.held, "brand_include", fams)
            noun = form.format(b=shown, x=noun)

        parts: list[str] = [noun]
        if material_suffix:
            parts.append(material_suffix)
        if rng.random() < 0.2:
            excl = brand_pool.pick(rng, split)
            if excl not in p.get("brands_include", []):
                p["brands_exclude"] = [excl]
                parts.append(_pick_form(rng, split, EXCLUDE_FORMS.seen, EXCLUDE_FORMS.held,
                                        "negation", fams).format(b=excl))
        if category in SIZES and rng.random() < 0.4:
            s = SIZES[category].pick(rng, split)
            p["size"] = s
            shown = s
            if s in SIZE_WORDS and rng.random() < 0.4:
                shown = SIZE_WORDS[s]
                fams.append("size:word")
            parts.append(_pick_form(rng, split, SIZE_FORMS.seen, SIZE_FORMS.held, "size", fams).format(s=shown))
        if rng.random() < (0.6 if split == "train" else 0.5):
            cur = rng.choices(list(CURRENCY_WEIGHTS), weights=list(CURRENCY_WEIGHTS.values()))[0]
            p["currency"] = cur
            kind = rng.random()
            # Shoppers mostly state a ceiling (60% max, 20% min, 20% range). The model picks the
            # direction at one token, "price" -> "_min" | "_max" (a range starts with _min), and a
            # small model leans on that token's prior: at 60/20/20 it read floors as ceilings, at
            # 40/35/25 ceilings as floors. Training makes the two even: 50% max, 25% min, 25% range.
            p_max, p_min = (0.5, 0.75) if split == "train" else (0.6, 0.8)
            if kind < p_max:
                a = _price_amount(rng, cur)
                p["price_max"] = a
                form = _pick_form(rng, split, PRICE_MAX.seen, PRICE_MAX.held, "price_max", fams)
                parts.append(form.format(p=_money(rng, split, a, cur, fams)))
            elif kind < p_min:
                a = _price_amount(rng, cur)
                p["price_min"] = a
                form = _pick_form(rng, split, PRICE_MIN.seen, PRICE_MIN.held, "price_min", fams)
                parts.append(form.format(p=_money(rng, split, a, cur, fams)))
            else:
                a, b = sorted(rng.sample([_price_amount(rng, cur) for _ in range(4)], 2))
                if a == b:
                    b = a * 2
                p["price_min"], p["price_max"] = a, b
                form = _pick_form(rng, split, PRICE_RANGE.seen, PRICE_RANGE.held, "price_range", fams)
                parts.append(form.format(a=_fmt_amount(rng, a, fams, split), b=_money(rng, split, b, cur, fams)))
        if rng.random() < 0.2:
            r = rng.choice([3, 3.5, 4, 4.5]) if split == "train" else rng.choice([3, 3.5, 4, 4.2, 4.5, 4.8])
            p["min_rating"] = float(r)
            parts.append(_pick_form(rng, split, RATING.seen, RATING.held, "rating", fams).format(r=f"{r:g}"))
        if rng.random() < 0.2:
            s = rng.choice(list(SORTS))
            p["sort"] = s
            parts.append(_pick_form(rng, split, *SORTS[s], "sort", fams))
        if rng.random() < 0.2:
            d = rng.choice(list(DELIVERY))
            p["delivery"] = d
            parts.append(_pick_form(rng, split, *DELIVERY[d], "delivery", fams))
        if rng.random() < 0.15:
            p["in_stock"] = True
            parts.append(_pick_form(rng, split, IN_STOCK.seen, IN_STOCK.held, "in_stock", fams))

        head, tail = parts[0], parts[1:]
        rng.shuffle(tail)
        sep = rng.choice([" ", ", "])
        opener = _pick_form(rng, split, OPENERS.seen, OPENERS.held, "opener", fams)
        text = opener + sep.join([head] + tail)
        if rng.random() < 0.1:
            text = text.upper() if rng.random() < 0.3 else text.capitalize()
            fams.append("case")
        return text, SearchParams(**p), fams

    def compare(self) -> tuple[str, SearchParams, list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        category, product = self._product()
        pool = BRANDS[category]
        a = pool.pick(rng, split)
        b = pool.pick(rng, split)
        while b == a:
            b = rng.choice(pool.seen + pool.held)
        form = _pick_form(rng, split, COMPARE_FORMS.seen, COMPARE_FORMS.held, "compare", fams)
        params = SearchParams(intent="compare", keywords=product, category=category, brands_include=[a, b])
        return form.format(a=a, b=b, x=product), params, fams

    def refine(self) -> tuple[str, list[Turn], SearchParams, list[str], str]:
        """A follow-up turn whose gold merges the conversation so far."""
        rng, split = self.rng, self.split
        first_text, prev, fams = self.search()
        history = [Turn(role="user", content=first_text), Turn(role="assistant", content=canonical_json(prev))]
        if rng.random() < 0.3:  # two refinements deep
            text, prev, f2 = self._refine_step(prev)
            fams += f2
            history += [Turn(role="user", content=text), Turn(role="assistant", content=canonical_json(prev))]
        text, gold, f3 = self._refine_step(prev)
        return text, history, gold, fams + f3, f3[0].split(":")[0]

    def _refine_step(self, prev: SearchParams) -> tuple[str, SearchParams, list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        p = canonical_dict(prev)
        p["intent"] = "refine"
        category = p["category"]
        kinds = list(REFINE_FORMS)
        if category not in COLORED:
            kinds.remove("color_swap")
            kinds.remove("color_add")
        if not p.get("brands_include"):
            kinds.remove("drop_brand")
        if category not in SIZES:
            kinds.remove("size")
        kind = rng.choice(kinds)
        form = _pick_form(rng, split, *REFINE_FORMS[kind], f"refine_{kind}", fams)
        args: dict[str, str] = {}
        if kind == "cheaper":
            p["sort"] = "price_asc"
        elif kind in ("color_swap", "color_add"):
            c = COLORS.pick(rng, split)
            while c in p.get("colors", []):
                c = COLORS.pick(rng, split)
            p["colors"] = [c] if kind == "color_swap" else p.get("colors", []) + [c]
            args["c"] = c
        elif kind == "drop_brand":
            p.pop("brands_include", None)
        elif kind == "exclude":
            b = BRANDS[category].pick(rng, split)
            p["brands_exclude"] = sorted(set(p.get("brands_exclude", [])) | {b})
            p["brands_include"] = [x for x in p.get("brands_include", []) if x != b]
            args["b"] = b
        elif kind == "price":
            cur = p.get("currency", "USD")
            a = _price_amount(rng, cur)
            p["price_max"], p["currency"] = a, cur
            if p.get("price_min") is not None and p["price_min"] >= a:
                p.pop("price_min")
            args["p"] = _money(rng, split, a, cur, fams)
        elif kind == "size":
            s = SIZES[category].pick(rng, split)
            p["size"] = s
            args["s"] = s
        elif kind == "stock":
            p["in_stock"] = True
        elif kind == "sort":
            p["sort"] = "rating"
        elif kind == "delivery":
            p["delivery"] = "free_shipping"
        return form.format(**args), SearchParams(**p), fams

    # --- support ----------------------------------------------------------
    def support(self) -> tuple[str, dict[str, Any], list[str]]:
        rng, split = self.rng, self.split
        fams: list[str] = []
        key = rng.choice(list(SUPPORT_FORMS))
        form = _pick_form(rng, split, *SUPPORT_FORMS[key], f"support_{key}", fams)
        topic = SupportTopic(key.removesuffix("_noid"))
        order_id = None
        if "{o}" in form:
            if rng.random() < 0.5:
                order_id = str(rng.randrange(10_000_000, 99_999_999))
            else:
                order_id = f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randrange(100, 999)}-{rng.randrange(1000, 9999)}"
            shown = order_id if rng.random() < 0.7 else "#" + order_id
            form = form.format(o=shown)
        pre = _pick_form(rng, split, SUPPORT_PREFIX.seen, SUPPORT_PREFIX.held, "support_prefix", fams)
        post = _pick_form(rng, split, SUPPORT_SUFFIX.seen, SUPPORT_SUFFIX.held, "support_suffix", fams)
        form = pre + form + post
        if rng.random() < 0.2:
            form = form.capitalize()
        return form, canonical_dict(support_reply(topic, order_id)), fams

    # --- one request --------------------------------------------------------
    def request(self, idx: int) -> Request:
        r = self.rng.random()
        history: list[Turn] = []
        if r < 0.2:
            query, gold_d, fams = self.support()
            task = "support"
            kind = "support"
        else:
            task = "search"
            if r < 0.25:
                query, gold, fams = self.compare()
                kind = "compare"
            elif r < 0.45:
                query, history, gold, fams, last_step = self.refine()
                kind = "refine"
            else:
                query, gold, fams = self.search()
                kind = "search"
            gold_d = canonical_dict(gold)
        meta: dict[str, Any] = {"kind": kind, "families": sorted(set(fams))}
        meta["unseen"] = unseen(meta["families"], gold_d)
        if kind == "refine":
            meta["last_step"] = last_step
        return Request(id=f"{self.split}-{idx:05d}", query=query, history=history, task=task, gold=gold_d,
                       meta=meta)


_HELD_VALUES: dict[str, set] = {
    "keywords": {x for pool in PRODUCTS.values() for x in pool.held},
    "brands_include": {x for pool in BRANDS.values() for x in pool.held},
    "brands_exclude": {x for pool in BRANDS.values() for x in pool.held},
    "colors": set(COLORS.held),
    "material": {x for pool in MATERIALS.values() for x in pool.held},
    "size": {x for pool in SIZES.values() for x in pool.held},
    "min_rating": {4.2, 4.8},  # training only rates 3, 3.5, 4, 4.5
}


def unseen(families: list[str], gold: dict[str, Any]) -> str:
    """What in a request training never showed: "none", "values", "phrasings" or "both"."""
    phrasing = any(f.endswith(":held") for f in families)
    value = any(v in _HELD_VALUES[k] for k, vals in gold.items() if k in _HELD_VALUES
                for v in (vals if isinstance(vals, list) else [vals]))
    return {(False, False): "none", (False, True): "values", (True, False): "phrasings",
            (True, True): "both"}[(phrasing, value)]


def generate(split: Split, n: int, seed: int | None = None) -> list[Request]:
    """``n`` requests for a split; the same (split, n, seed) always gives the same list."""
    gen = Generator(split, seed)
    out: list[Request] = []
    seen_queries: set[tuple] = set()
    idx = 0
    while len(out) < n:
        req = gen.request(idx)
        idx += 1
        key = (req.query, tuple(t.content for t in req.history))
        if key in seen_queries:
            continue
        seen_queries.add(key)
        req.id = f"{split}-{len(out):05d}"
        out.append(req)
    return out


DEFAULT_SIZES: dict[Split, int] = {"train": 4000, "dev": 200, "test": 400}
