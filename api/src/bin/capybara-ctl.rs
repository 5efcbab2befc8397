//! `capybara-ctl ARGS` = `capybara ctl ARGS` (development and tests).
fn main() {
    std::process::exit(capybara_api::ctl::ctl_main(
        std::env::args().skip(1).collect(),
    ));
}
